"""`KVBatch`: the running batch of the hf engine, one left-padded KV cache shared by all active sequences.

Layout: every layer's keys/values are [B, kv_heads, T, head_dim] (a transformers DynamicCache), `mask_BT` marks
real positions (1) vs left padding (0), `pos_B` is the position id of each row's next input token and `next_B`
that token (sampled, not yet in the cache). New rows are prefilled (once per distinct prompt, then the cache is
copied to each of its n rows) and joined by left-padding whichever side is shorter; removed rows leave, and
leading columns that are padding in every row are trimmed so the cache does not grow without bound.

After a weight swap `rebuild` recomputes the cache of every active row with the new weights (as vLLM does by
clearing its cache under pause_generation(mode="keep")), so a token labelled with a version was sampled from
exactly that version's forward of the whole context.

Padding never changes a real row's numbers: padded key/value slots are zeroed and masked out (a padding query
attends to nothing, so whatever the model stored there is discarded rather than trusted).
"""

from __future__ import annotations

from typing import Any

import torch


def _left_pad(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    if x.shape[dim] == width:
        return x
    shape = list(x.shape)
    shape[dim] = width - x.shape[dim]
    return torch.cat([x.new_zeros(shape), x], dim=dim)


class KVBatch:
    """Active rows (opaque objects, one per sequence) and their shared cache."""

    def __init__(self, model: Any) -> None:
        self._model = model
        # Every tensor of the batch (ids, masks, positions, the cache) lives where the model does.
        self.device = getattr(model, "device", None) or torch.device("cpu")
        self.rows: list[Any] = []
        self._cache: Any = None
        self._mask_BT = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self.next_B = torch.zeros(0, dtype=torch.long, device=self.device)
        self.pos_B = torch.zeros(0, dtype=torch.long, device=self.device)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def cache_len(self) -> int:
        return int(self._mask_BT.shape[1])

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], rows_per_prompt: list[list[Any]]) -> torch.Tensor:
        """Run the prompts, append one row per entry of rows_per_prompt[i] (all sharing prompt i), and
        return the next-token logits [new_rows, V] of the appended rows (in order)."""
        from transformers import DynamicCache

        width = max(len(p) for p in prompts)
        ids_GL = torch.zeros(len(prompts), width, dtype=torch.long)
        mask_GL = torch.zeros(len(prompts), width, dtype=torch.long)
        for g, prompt in enumerate(prompts):
            ids_GL[g, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask_GL[g, width - len(prompt) :] = 1
        ids_GL, mask_GL = ids_GL.to(self.device), mask_GL.to(self.device)
        cache = DynamicCache(config=self._model.config)
        out = self._model(
            input_ids=ids_GL,
            attention_mask=mask_GL,
            position_ids=(mask_GL.cumsum(-1) - 1).clamp(min=0),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        expand = torch.tensor([g for g, rows in enumerate(rows_per_prompt) for _ in rows], device=self.device)
        pad_G1L1 = (mask_GL == 0)[:, None, :, None]
        for layer in cache.layers:
            layer.keys = layer.keys.masked_fill(pad_G1L1, 0.0).index_select(0, expand)
            layer.values = layer.values.masked_fill(pad_G1L1, 0.0).index_select(0, expand)
        new_rows = [row for rows in rows_per_prompt for row in rows]
        pos_B = torch.tensor([len(prompts[g]) for g in expand.tolist()], dtype=torch.long, device=self.device)
        self._join(new_rows, cache, mask_GL.index_select(0, expand), pos_B)
        return out.logits[:, -1].index_select(0, expand).float()

    @torch.no_grad()
    def decode(self) -> torch.Tensor:
        """Feed every row's next token; return next-token logits [B, V]."""
        rows = len(self.rows)
        self._mask_BT = torch.cat([self._mask_BT, torch.ones(rows, 1, dtype=torch.long, device=self.device)], dim=1)
        out = self._model(
            input_ids=self.next_B[:, None],
            attention_mask=self._mask_BT,
            position_ids=self.pos_B[:, None],
            past_key_values=self._cache,
            use_cache=True,
        )
        self.pos_B = self.pos_B + 1
        return out.logits[:, -1].float()

    def _join(self, rows: list[Any], cache: Any, mask_BT: torch.Tensor, pos_B: torch.Tensor) -> None:
        if not self.rows:
            self.rows, self._cache, self._mask_BT, self.pos_B = list(rows), cache, mask_BT, pos_B
            self.next_B = torch.zeros(len(rows), dtype=torch.long, device=self.device)
            return
        width = max(self.cache_len, mask_BT.shape[1])
        for old, new in zip(self._cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([_left_pad(old.keys, width, 2), _left_pad(new.keys, width, 2)])
            old.values = torch.cat([_left_pad(old.values, width, 2), _left_pad(new.values, width, 2)])
        self._mask_BT = torch.cat([_left_pad(self._mask_BT, width, 1), _left_pad(mask_BT, width, 1)])
        self.pos_B = torch.cat([self.pos_B, pos_B])
        self.next_B = torch.cat([self.next_B, torch.zeros(len(rows), dtype=torch.long, device=self.device)])
        self.rows.extend(rows)

    def rebuild(self, contexts: list[list[int]]) -> None:
        """Recompute every row's cache from its context (prompt + tokens already fed), e.g. after the
        weights changed: the KV entries of the old weights must not leak into the new version's tokens.
        Rows, their next tokens and positions stay as they were."""
        if len(contexts) != len(self.rows):
            raise ValueError(f"rebuild needs one context per row ({len(self.rows)}), got {len(contexts)}")
        rows, next_B = self.rows, self.next_B.clone()
        self.keep([])
        self.prefill(contexts, [[row] for row in rows])
        self.next_B = next_B

    def keep(self, indices: list[int]) -> None:
        """Keep only the rows at `indices` (in order) and trim all-padding leading columns."""
        if len(indices) == len(self.rows):
            return
        if not indices:
            self.rows, self._cache = [], None
            self._mask_BT = torch.zeros(0, 0, dtype=torch.long, device=self.device)
            self.next_B = self.pos_B = torch.zeros(0, dtype=torch.long, device=self.device)
            return
        index = torch.tensor(indices, device=self.device)
        self.rows = [self.rows[i] for i in indices]
        mask_BT = self._mask_BT.index_select(0, index)
        start = int(mask_BT.any(dim=0).long().argmax())  # first column some row still uses
        self._mask_BT = mask_BT[:, start:]
        self.next_B = self.next_B.index_select(0, index)
        self.pos_B = self.pos_B.index_select(0, index)
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, start:]
            layer.values = layer.values.index_select(0, index)[:, :, start:]
