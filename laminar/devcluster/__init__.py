"""The dev cluster: a real multi-node Ray cluster on one machine, for tests and benchmarks.

- `netns.py`: emulated nodes, one network namespace each, joined by veth pairs to a bridge
  (links capped and delayed with `tc`).
- `nscluster.py`: `NamespacedCluster`, a head raylet plus worker raylets each in its own
  network and mount namespace (`laminar cluster up | down`).
- `status.py`: `laminar cluster status`, the nodes and the relay chains of the jobs on a cluster.

Jobs reach such a cluster only through `cluster.address`, as they would a real one; nothing in
laminar/runtime/ imports this package.
"""
