"""The forward pass: a Hugging Face decoder's own weights run over laminar's slot KV buffer.

    runner = ModelRunner(model, num_slots=64)
    logits = runner.run(decode_tokens, decode_positions, prefill_contexts)   # [rows, vocab]

One call is one engine step, decode and prefill together in a single pass:
- rows 0..n-1 decode one token each (the token sampled last step, at its position);
- rows n..n+m-1 are newly admitted sequences, prefilled from scratch (prompt, plus the tokens
  already generated when resuming).
Every token-wise op (norms, projections, rotary, MLP) runs once over the flat list of all the
step's tokens; only attention splits: decode rows attend over their slot's cached keys (a view
of the buffer, masked by length, as batched matmuls), prefill rows attend causally over their
own fresh keys. Each step writes only its new keys and values into the buffer — nothing is
re-padded or concatenated. In the last layer only each row's last token goes on (the other
prefill tokens just leave their keys and values), and logits are computed for those alone.

Parts: `_LayerWeights` (references to the model's parameters, re-read by `refresh()`),
`ModelRunner.run` (inputs → logits), `ModelRunner.verify` (several tokens per decode row:
speculative drafts checked in one pass, speculation.py), `_decode_attention` / `_attention` /
`_verify_attention`, `_AttentionPlan` and `_VerifyPlan` (the per-step masks and indices every
layer shares), `check_supported`. The maths mirrors
`transformers`' Qwen2/Llama/Qwen3/Mistral modules op for op (RMSNorm in float32, rotary from
the model's own rotary module), so greedy decoding matches `generate` token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from laminar.engine.kv_cache import KVCache

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")
# rope types whose cos/sin at a position do not depend on the sequence length seen so far
_POSITION_ONLY_ROPE = ("default", "linear", "llama3", "yarn")


@dataclass(slots=True)
class _LayerWeights:
    ln1: torch.Tensor
    ln2: torch.Tensor
    q: torch.Tensor
    q_bias: torch.Tensor | None
    k: torch.Tensor
    k_bias: torch.Tensor | None
    v: torch.Tensor
    v_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3 normalises q and k per head
    k_norm: torch.Tensor | None
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_bias: torch.Tensor | None
    up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_slots: int) -> None:
        config = model.config
        check_supported(config)
        self.model = model  # only weights and the rotary module are used: mode left alone
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.group = self.num_heads // self.num_kv_heads
        self.vocab_size = config.vocab_size
        self.max_positions = config.max_position_embeddings
        self.num_slots = num_slots
        self.kv = KVCache(config.num_hidden_layers, num_slots, self.num_kv_heads, self.head_dim,
                          self.max_positions, self.dtype, self.device)
        self._slot_ids = torch.arange(num_slots, device=self.device)
        self.refresh()
        self._cos = self._sin = torch.empty(0, self.head_dim, dtype=self.dtype)

    def refresh(self) -> None:
        """Re-read parameter references from the model (after parameters were replaced)."""
        base = self.model.model
        self.embed = base.embed_tokens.weight
        self.norm = base.norm.weight
        self.eps = base.norm.variance_epsilon
        self.lm_head = self.model.lm_head.weight
        self.act = base.layers[0].mlp.act_fn
        self.scale = base.layers[0].self_attn.scaling
        self.layers = [_layer_weights(layer) for layer in base.layers]

    # -- rotary tables ---------------------------------------------------------------------------

    def _rotary(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin tables [positions, head_dim], grown by doubling."""
        if num_positions > self._cos.shape[0]:
            size = min(self.max_positions, max(num_positions, 2 * self._cos.shape[0], 64))
            positions = torch.arange(size, device=self.device)[None, :]
            probe = torch.empty(0, dtype=self.dtype, device=self.device)
            cos, sin = self.model.model.rotary_emb(probe, positions)
            half = self.head_dim // 2
            # rotate_half(x) * sin == roll(x, half) * [-sin_low, sin_high], exactly
            self._cos = cos[0]
            self._sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
        return self._cos, self._sin

    # -- the step --------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, decode_tokens: list[int], decode_positions: list[int],
            prefill: list[list[int]], first_slot: int = 0) -> torch.Tensor:
        """Logits [n + m, vocab] for the last token of each decode row, then each prefill row.
        Rows occupy slots first_slot.. (a step that verifies drafts prefills after them)."""
        n, m = len(decode_tokens), len(prefill)
        lengths = [len(ctx) for ctx in prefill]
        width = max(lengths, default=0)
        longest = max(max(decode_positions, default=-1) + 1, width)
        self.kv.reserve(longest)
        cos_table, sin_table = self._rotary(longest)
        dev = self.device

        if m == 0:
            ids = torch.tensor(decode_tokens, device=dev)
            pos = torch.tensor(decode_positions, device=dev)
            slots = self._slot_ids[:n]
            last = None
        else:
            ids = torch.tensor(decode_tokens + [t for ctx in prefill for t in ctx], device=dev)
            pos = torch.tensor(decode_positions + [p for n_ in lengths for p in range(n_)],
                               device=dev)
            slots = torch.tensor(list(range(n)) + [n + j for j, n_ in enumerate(lengths)
                                                   for _ in range(n_)], device=dev)
            last = torch.tensor(_prefill_last_index(n, lengths), device=dev)
        attn = _AttentionPlan.build(n, decode_positions, lengths, width, self.num_kv_heads,
                                    self.dtype, dev)

        cos = cos_table[pos][:, None, :]  # [T, 1, head_dim], broadcast over heads
        sin = sin_table[pos][:, None, :]
        half = self.head_dim // 2
        x = F.embedding(ids, self.embed)  # [T, hidden]
        num_tokens, final = x.shape[0], len(self.layers) - 1
        for index, w in enumerate(self.layers):
            h = _rms_norm(x, w.ln1, self.eps)
            k = F.linear(h, w.k, w.k_bias).view(num_tokens, self.num_kv_heads, self.head_dim)
            v = F.linear(h, w.v, w.v_bias).view(num_tokens, self.num_kv_heads, self.head_dim)
            if index == final and last is not None:
                # only each row's last token goes on: the other prefill tokens' keys and values
                # are all the last layer must contribute, so their queries, attention, output
                # projection and MLP are skipped and every row attends like a decode row
                h, x = h[last], x[last]
                q_cos, q_sin = cos[last], sin[last]
            else:
                q_cos, q_sin = cos, sin
            q = F.linear(h, w.q, w.q_bias).view(h.shape[0], self.num_heads, self.head_dim)
            if w.q_norm is not None:
                q = _rms_norm(q, w.q_norm, self.eps)
                k = _rms_norm(k, w.k_norm, self.eps)
            q = q * q_cos + torch.roll(q, half, dims=-1) * q_sin
            k = k * cos + torch.roll(k, half, dims=-1) * sin
            k_cache, v_cache = self.kv.layer(index)
            if first_slot:  # views: the rows' slots from 0
                k_cache, v_cache = k_cache[first_slot:], v_cache[first_slot:]
            k_cache[slots, :, pos] = k
            v_cache[slots, :, pos] = v
            if index == final and last is not None:
                out = self._decode_attention(q, k_cache, v_cache, attn.final_bias)
            else:
                out = self._attention(q, k_cache, v_cache, attn)
            x = x + F.linear(out, w.o, w.o_bias)
            h = _rms_norm(x, w.ln2, self.eps)
            h = self.act(F.linear(h, w.gate, w.gate_bias)) * F.linear(h, w.up, w.up_bias)
            x = x + F.linear(h, w.down, w.down_bias)
        return F.linear(_rms_norm(x, self.norm, self.eps), self.lm_head)

    @torch.inference_mode()
    def verify(self, feeds: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Speculative verification: row i (slot i) feeds `feeds[i]` (its last token, then its
        draft) at positions starts[i].. over its cached keys. Logits [sum(len(feed)), vocab]
        for every fed token, row by row. Token-wise ops run over the packed tokens; attention
        pads each row's queries to the longest feed (`_VerifyPlan`, built once per step)."""
        lengths = [len(feed) for feed in feeds]
        longest = max(s + n for s, n in zip(starts, lengths))
        self.kv.reserve(longest)
        cos_table, sin_table = self._rotary(longest)
        dev = self.device
        ids = torch.tensor([t for feed in feeds for t in feed], device=dev)
        pos = torch.tensor([s + j for s, n in zip(starts, lengths) for j in range(n)], device=dev)
        slots = torch.tensor([r for r, n in enumerate(lengths) for _ in range(n)], device=dev)
        plan = _VerifyPlan.build(starts, lengths, longest, self.num_kv_heads, self.group,
                                 self.dtype, dev)

        cos = cos_table[pos][:, None, :]
        sin = sin_table[pos][:, None, :]
        half = self.head_dim // 2
        x = F.embedding(ids, self.embed)  # [T, hidden]
        num_tokens = x.shape[0]
        for index, w in enumerate(self.layers):
            h = _rms_norm(x, w.ln1, self.eps)
            q = F.linear(h, w.q, w.q_bias).view(num_tokens, self.num_heads, self.head_dim)
            k = F.linear(h, w.k, w.k_bias).view(num_tokens, self.num_kv_heads, self.head_dim)
            v = F.linear(h, w.v, w.v_bias).view(num_tokens, self.num_kv_heads, self.head_dim)
            if w.q_norm is not None:
                q = _rms_norm(q, w.q_norm, self.eps)
                k = _rms_norm(k, w.k_norm, self.eps)
            q = q * cos + torch.roll(q, half, dims=-1) * sin
            k = k * cos + torch.roll(k, half, dims=-1) * sin
            k_cache, v_cache = self.kv.layer(index)
            k_cache[slots, :, pos] = k
            v_cache[slots, :, pos] = v
            out = self._verify_attention(q, k_cache, v_cache, plan)
            x = x + F.linear(out, w.o, w.o_bias)
            h = _rms_norm(x, w.ln2, self.eps)
            h = self.act(F.linear(h, w.gate, w.gate_bias)) * F.linear(h, w.up, w.up_bias)
            x = x + F.linear(h, w.down, w.down_bias)
        return F.linear(_rms_norm(x, self.norm, self.eps), self.lm_head)

    def _verify_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          plan: "_VerifyPlan") -> torch.Tensor:
        """q [T, heads, head_dim] (rows' fed tokens, packed) -> [T, heads * head_dim]: each
        KV head's G query heads times the row's (padded) fed tokens are query rows against that
        head's cache, as in decode attention; one gather in, one gather out."""
        rows, hd, length = plan.num_rows, self.head_dim, plan.bias.shape[-1]
        groups, heads = rows * self.num_kv_heads, plan.heads
        # [T, kv_heads, G, hd] gathered to [rows, kv_heads, width, G, hd]: no transpose copy
        qg = q.view(-1, self.num_kv_heads, self.group, hd)[plan.token_index, heads[:, None]]
        keys = k_cache[:rows, :, :length].reshape(groups, length, hd)
        values = v_cache[:rows, :, :length].reshape(groups, length, hd)
        scores = torch.baddbmm(plan.bias, qg.view(groups, -1, hd), keys.transpose(1, 2),
                               alpha=self.scale)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.bmm(probs, values).view(rows, self.num_kv_heads, -1, self.group, hd)
        return out[plan.row_index, heads, plan.column_index].view(q.shape[0],
                                                                  self.num_heads * hd)

    def _decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          bias: torch.Tensor) -> torch.Tensor:
        """One query token per row against its slot's cache: q [rows, heads, head_dim] ->
        [rows, heads * head_dim]. `bias` [rows * kv_heads, 1, length]: 0 or -inf."""
        rows, length = q.shape[0], bias.shape[-1]
        groups = rows * self.num_kv_heads
        # grouped-query attention without repeating keys: a KV head's G query heads are G
        # query rows against that head's cache; batched matmuls beat the CPU flash kernel here
        qg = q.view(groups, self.group, self.head_dim)
        keys = k_cache[:rows, :, :length].reshape(groups, length, self.head_dim)
        values = v_cache[:rows, :, :length].reshape(groups, length, self.head_dim)
        scores = torch.baddbmm(bias, qg, keys.transpose(1, 2), alpha=self.scale)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.bmm(probs, values).view(rows, self.num_heads * self.head_dim)

    def _attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   plan: "_AttentionPlan") -> torch.Tensor:
        """q [T, heads, head_dim] -> attention output [T, heads * head_dim]."""
        n, m, hd = plan.num_decode, plan.num_prefill, self.num_heads * self.head_dim
        parts = []
        if n:
            parts.append(self._decode_attention(q[:n], k_cache, v_cache, plan.decode_bias))
        if m:
            width = plan.width
            # right-padded [m, heads, width, head_dim]; causal masking keeps every real query
            # away from the padding (and from stale cache entries past its row's length)
            qp = q[n:][plan.pad_index].view(m, width, self.num_heads, self.head_dim).transpose(1, 2)
            out = F.scaled_dot_product_attention(
                qp, k_cache[n:n + m, :, :width], v_cache[n:n + m, :, :width],
                is_causal=True, scale=self.scale, enable_gqa=self.group > 1)
            parts.append(out.transpose(1, 2).reshape(m * width, hd)[plan.valid_index])
        return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass(slots=True)
class _AttentionPlan:
    """Per-step index and mask tensors that every layer's attention reuses."""

    num_decode: int
    num_prefill: int
    decode_bias: torch.Tensor | None  # [n * kv_heads, 1, L] additive mask of the decode rows
    final_bias: torch.Tensor | None  # the same for all n + m rows (last layer, prefill steps)
    width: int  # padded prefill length
    pad_index: torch.Tensor | None  # [m * width] flat prefill token for each padded position
    valid_index: torch.Tensor | None  # [sum(lengths)] padded position of each flat token

    @staticmethod
    def build(n: int, positions: list[int], lengths: list[int], width: int, kv_heads: int,
              dtype: torch.dtype, device: torch.device) -> "_AttentionPlan":
        decode_bias = final_bias = pad_index = valid_index = None
        if n:
            decode_bias = _length_bias(positions, kv_heads, dtype, device)
        if lengths:
            final_bias = _length_bias(positions + [n_ - 1 for n_ in lengths], kv_heads, dtype,
                                      device)
            pad_index, valid_index = _pad_valid(lengths, width, device)
        return _AttentionPlan(n, len(lengths), decode_bias, final_bias, width, pad_index,
                              valid_index)


@dataclass(slots=True)
class _VerifyPlan:
    """A verify step's attention layout, built once and shared by every layer. Query rows are
    (row, KV head, fed token j) with j padded to the longest feed (`width`; a padded j repeats
    the row's last token, its output is dropped); `bias` [rows * kv_heads, width * G, longest]
    lets (row, j) see keys 0..starts[row] + j. The gathers are advanced indexing with
    broadcast index tensors: [rows, 1, width] x [1, kv_heads, 1] in, [T, 1] x [1, kv_heads] out."""

    num_rows: int
    bias: torch.Tensor
    token_index: torch.Tensor  # [rows, 1, width]: the packed token at each padded (row, j)
    row_index: torch.Tensor  # [T, 1]: each packed token's row
    column_index: torch.Tensor  # [T, 1]: ... and its j
    heads: torch.Tensor  # [kv_heads]

    @staticmethod
    def build(starts: list[int], lengths: list[int], longest: int, kv_heads: int, group: int,
              dtype: torch.dtype, device: torch.device) -> "_VerifyPlan":
        rows, width = len(lengths), max(lengths)
        padded, row_of, column_of, offset = [], [], [], 0
        for row, n in enumerate(lengths):
            padded.extend(range(offset, offset + n))
            padded.extend([offset + n - 1] * (width - n))
            row_of.extend([row] * n)
            column_of.extend(range(n))
            offset += n
        last = (torch.tensor(starts, device=device)[:, None]
                + torch.arange(width, device=device)[None, :])  # [rows, width]
        keys = torch.arange(longest, device=device)
        bias = torch.zeros(rows, 1, width, 1, longest, dtype=dtype, device=device)
        bias.masked_fill_((keys > last[:, :, None])[:, None, :, None, :], float("-inf"))
        bias = bias.expand(rows, kv_heads, width, group, longest).reshape(
            rows * kv_heads, width * group, longest)
        return _VerifyPlan(rows, bias, torch.tensor(padded, device=device).view(rows, 1, width),
                           torch.tensor(row_of, device=device)[:, None],
                           torch.tensor(column_of, device=device)[:, None],
                           torch.arange(kv_heads, device=device))


def _length_bias(positions: list[int], kv_heads: int, dtype: torch.dtype, device: torch.device
                 ) -> torch.Tensor:
    """Additive mask [rows * kv_heads, 1, max(positions) + 1]: row r sees keys 0..positions[r]."""
    pos = torch.tensor(positions, device=device)
    keys = torch.arange(int(max(positions)) + 1, device=device)
    bias = torch.zeros(len(positions), keys.shape[0], dtype=dtype, device=device)
    bias.masked_fill_(keys[None, :] > pos[:, None], float("-inf"))
    return bias.repeat_interleave(kv_heads, dim=0)[:, None, :]


def _prefill_last_index(n: int, lengths: list[int]) -> list[int]:
    """Flat index of each row's last token: decode rows 0..n-1, then each prefill row's end."""
    index, offset = list(range(n)), n
    for length in lengths:
        offset += length
        index.append(offset - 1)
    return index


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # as transformers: normalise in float32, cast back, then scale
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _layer_weights(layer: torch.nn.Module) -> _LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    q_norm = getattr(attn, "q_norm", None)
    k_norm = getattr(attn, "k_norm", None)
    return _LayerWeights(
        ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
        q=attn.q_proj.weight, q_bias=attn.q_proj.bias, k=attn.k_proj.weight,
        k_bias=attn.k_proj.bias, v=attn.v_proj.weight, v_bias=attn.v_proj.bias,
        o=attn.o_proj.weight, o_bias=attn.o_proj.bias,
        q_norm=q_norm.weight if q_norm is not None else None,
        k_norm=k_norm.weight if k_norm is not None else None,
        gate=mlp.gate_proj.weight, up=mlp.up_proj.weight, down=mlp.down_proj.weight,
        gate_bias=mlp.gate_proj.bias, up_bias=mlp.up_proj.bias, down_bias=mlp.down_proj.bias)


def check_supported(config) -> None:
    """Raise a clear error for architectures or settings this forward does not reproduce."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"the native engine supports model_type in {SUPPORTED_MODEL_TYPES}, got "
                         f"'{model_type}'; use rollout.engine.backend=vllm for other architectures")
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type not in _POSITION_ONLY_ROPE:
        raise ValueError(f"rope_type='{rope_type}' is not supported by the native engine (cos/sin "
                         f"must depend on the position only: {_POSITION_ONLY_ROPE}); use "
                         "rollout.engine.backend=vllm")
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or ()
    if "sliding_attention" in layer_types or (
            window is not None and model_type == "mistral"
            and window < config.max_position_embeddings):
        raise ValueError("sliding-window attention is not supported by the native engine; use "
                         "rollout.engine.backend=vllm or a config without sliding_window")


def _pad_valid(lengths: list[int], width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `lengths` tokens packed one after another -> (index padding them to `width`
    columns, repeating each row's last token; index of the real tokens in that padded layout)."""
    pad, valid, offset = [], [], 0
    for row, n in enumerate(lengths):
        pad.extend(offset + min(j, n - 1) for j in range(width))
        valid.extend(row * width + j for j in range(n))
        offset += n
    return torch.tensor(pad, device=device), torch.tensor(valid, device=device)
