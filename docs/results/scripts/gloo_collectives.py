"""Time of gloo collectives between two local processes (1 thread each), alone on the machine
(a scratch experiment behind the figures docs/trainer.md quotes; not part of the package).

    .venv/bin/python docs/results/scripts/gloo_collectives.py

Prints, per shard size, the mean ms of all_gather_into_tensor, reduce_scatter_tensor (input of
two shards), all_reduce (one shard) and barrier over 20 calls after 3 warm-up calls.
"""
import time, torch, torch.distributed as dist, torch.multiprocessing as mp
def main(rank, n):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=rank, world_size=2)
    for numel in (1<<14, 1<<18, 1<<20):
        x = torch.randn(numel); out = torch.empty(numel*2); big = torch.randn(numel*2); rs = torch.empty(numel)
        res = {}
        for name, fn in [("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(out, x)),
                         ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(rs, big)),
                         ("all_reduce", lambda: dist.all_reduce(x)),
                         ("barrier", lambda: dist.barrier())]:
            try:
                for _ in range(3): fn()
                t = time.perf_counter()
                for _ in range(n): fn()
                res[name] = (time.perf_counter() - t) / n * 1e3
            except Exception as e:
                res[name] = f"ERR {type(e).__name__}: {str(e)[:80]}"
        if rank == 0: print(f"{numel*4/1e6:6.2f} MB shard:", {k: (round(v,2) if isinstance(v,float) else v) for k,v in res.items()}, flush=True)
    dist.destroy_process_group()
if __name__ == "__main__":
    mp.spawn(main, args=(20,), nprocs=2)
