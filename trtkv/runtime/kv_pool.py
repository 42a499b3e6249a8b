"""The paged KV cache the runtime owns: every layer's pools stacked, plus the fp16 open blocks.

Tensors (the step network's cache inputs, docs/kv-cache-format.md "The engine step contract")::

    k_data, v_data    [L, num_blocks, H, block_size, packed_dim]   the format's storage dtype
    k_scale, k_zero   [L, *scale_shape]                             fp16, when the format has them
    v_scale, v_zero
    k_tail, v_tail    [L, num_slots, H, block_size + sink, D]       fp16 open blocks, then sink rows

With a ``WindowRing`` (trtkv.cache_layout: the sliding layers free the blocks their window has passed) the sliding
layers' pools are separate tensors, ``k_data@ring`` ... ``[L_sliding, num_slots * ring_blocks, ...]``, and
``k_data`` ... hold the global layers only; ``pool(layer, which)`` hides the difference. Only the torch engine
reads such a cache (its step contract is the same: the ring block follows from the slot).

Shapes, dtypes and the allocation itself come from the engine's ``PagedKVLayout`` (``EngineManifest.layout``). After each step
``write_new_rows`` copies every sequence's new K/V rows into its open block and, when the open block is
full, seals it into the pool block the sequence's block table names for it — the block manager allocates that block
before the step. The seal is the attention backend's (``trtkv.attention``): the engine stepping the cache hands it
its own (``seal_through``), so that the pool stores what that engine's attention reads; until then (a network engine,
a cache made on its own) the backend ``auto`` takes on the cache's device (``pool_sealer``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from trtkv.artifacts import LayerParams, tensors_to_params
from trtkv.attention import AttentionBackend, pool_reasons, pool_sealer
from trtkv.cache_layout import KVPool, PagedKVLayout, WindowRing, sealing, store_quantized
from trtkv.errors import TrtkvError
from trtkv.manifest import KV_PARAMS_FILE, KV_PARAMS_PREFIX, EngineManifest, accepts_any_shape
from trtkv.quant import QuantizedTensor
from trtkv.rope import RopeTable
from trtkv.runtime.step import StepBatch, StepOutput, StepSeals

POOL_FIELDS = ("data", "scale", "zero", "outlier_index", "outlier_value")  # a pool's tensors addressed by block (``KVPool``)
RING = "@ring"  # suffix of the sliding layers' pool tensors in a cache with a WindowRing


def load_kv_params(engine_dir: str | Path, num_layers: int) -> list[LayerParams]:
    """The KV constants an engine baked in (static scales, smoothing, clip): one ``LayerParams`` per layer."""
    from safetensors.torch import load_file

    path = Path(engine_dir) / KV_PARAMS_FILE
    if not path.is_file():
        raise TrtkvError(f"{path} is missing", "rebuild the engine with `trtkv build-engine ... --force`")
    params = tensors_to_params(load_file(str(path)), num_layers)
    return params.get(KV_PARAMS_PREFIX) or [LayerParams() for _ in range(num_layers)]


class PagedKVCache:
    """Stacked pools and open blocks for ``num_blocks`` pool blocks and ``num_slots`` sequence slots."""

    def __init__(
        self,
        layout: PagedKVLayout,
        num_layers: int,
        params: list[LayerParams] | None = None,
        device: torch.device | str = "cpu",
        ring: WindowRing | None = None,
        attention: AttentionBackend | None = None,
    ):
        self.layout = layout
        self.num_layers = num_layers
        self.ring = ring
        self.params = params or [LayerParams() for _ in range(num_layers)]
        if len(self.params) != num_layers:
            raise TrtkvError(f"{len(self.params)} layer params for {num_layers} layers", "use the engine's kv_params.safetensors")
        if ring is not None and ring.block_size != layout.block_size:
            raise ValueError(f"a window ring of {ring.block_size}-token blocks for a cache of {layout.block_size}")
        layout.fmt.check_layers(num_layers)
        for r in pool_reasons(layout.fmt):  # a format no engine path reads (outlier lists, keys before RoPE)
            raise TrtkvError(r, r.hint)
        # every layer's layout, made once: a per-layer format's ``layer(i)`` builds a format, not for every step
        self._layouts = [layout.layer(i) for i in range(num_layers)]
        # pool groups: layers with one storage (a per-layer format's distinct K / V storages, ``@gN``), the sliding layers
        # of a ring apart (``@ring``); layer -> (tensor-name suffix, index in that group's stacked tensors)
        local = set(ring.layers) if ring is not None else set()
        storages = list(dict.fromkeys((f.k, f.v) for f in layout.fmt.layer_formats()))
        groups: dict[str, list[int]] = {}
        for i in range(num_layers):
            lay = self._layouts[i]
            suffix = (f"@g{storages.index((lay.fmt.k, lay.fmt.v))}" if layout.fmt.is_per_layer else "") + (RING if i in local else "")
            groups.setdefault(suffix, []).append(i)
        self._where = {layer: (suffix, j) for suffix, layers in groups.items() for j, layer in enumerate(layers)}
        self.tensors: dict[str, torch.Tensor] = {}
        # each layer's RoPE table, for keys stored before RoPE (``prerope``): the engine stepping this cache hands them
        # over at its first step (the pool has no model of its own); layers that rotate alike share one table
        self.ropes: list[RopeTable] | None = None
        self.sealer: AttentionBackend = attention or pool_sealer(device)  # whose seal stores full blocks (``seal_through``)
        for which in ("k", "v"):  # the layout allocates: one group's pools stacked, a ring's with its ring blocks
            self.tensors[f"{which}_tail"] = layout.allocate_tail(device, layers=num_layers)
            for suffix, layers in groups.items():
                lay = self._layouts[layers[0]]
                if suffix.endswith(RING):
                    lay = dataclasses.replace(lay, num_blocks=layout.num_slots * ring.ring_blocks)
                pool = lay.allocate(which, device, layers=len(layers), tail=False)
                for field in POOL_FIELDS:
                    if getattr(pool, field) is not None:
                        self.tensors[f"{which}_{field}{suffix}"] = getattr(pool, field)

    @classmethod
    def for_engine(cls, manifest: EngineManifest, engine_dir: str | Path, num_blocks: int, num_slots: int, device="cpu", backend: str | None = None,
                   ring: WindowRing | None = None, attention: AttentionBackend | None = None) -> "PagedKVCache":
        """A cache for the engine in ``engine_dir`` (its layout and baked KV constants); ``backend``: the one that runs it
        (default: the manifest's); ``ring``: the sliding layers' window ring (the torch engine only); ``attention``: the
        engine's attention backend, which seals the cache."""
        lim = manifest.limits
        if num_blocks > lim.max_num_blocks or num_slots > lim.max_num_slots:
            if not accepts_any_shape(backend or manifest.backend):
                raise TrtkvError(
                    f"{num_blocks} blocks / {num_slots} slots exceed the engine's limits ({lim.max_num_blocks} / {lim.max_num_slots})",
                    "use a smaller pool or rebuild with a larger --max-batch / --max-seq-len",
                )
        layout = manifest.layout(num_blocks, num_slots)
        return cls(layout, manifest.model.num_layers, load_kv_params(engine_dir, manifest.model.num_layers), device, ring, attention)

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    def seal_through(self, attention: AttentionBackend) -> None:
        """Seal full blocks from now on with ``attention``'s seal (the engine stepping this cache hands its own)."""
        self.sealer = attention

    def layout_of(self, layer: int) -> PagedKVLayout:
        """The layout of ``layer``'s pools (its own storage under a per-layer format)."""
        return self._layouts[layer]

    @property
    def is_grouped(self) -> bool:
        """True when the layers' pools are not one stack (a window ring or a per-layer format): only the torch engine
        reads such a cache."""
        return self.ring is not None or self.layout.fmt.is_per_layer

    def is_ringed(self, layer: int) -> bool:
        """True when ``layer``'s sealed blocks live in the window ring (addressed by slot), not the block tables' pool."""
        return self._where[layer][0] == RING

    def pool(self, layer: int, which: str) -> KVPool:
        """Views of one layer's K or V pool (writes go into the stacked tensors); a ringed layer's pool blocks are its
        ring blocks (``WindowRing.block``)."""
        suffix, j = self._where[layer]
        get = lambda f: self.tensors.get(f"{which}_{f}{suffix}")
        sel = lambda t: None if t is None else t[j]
        return KVPool(**{f: sel(get(f)) for f in POOL_FIELDS}, tail=self.tensors[f"{which}_tail"][layer])

    def slot_index(self, name: str, slot: int) -> slice | None:
        """The entries of cache tensor ``name`` (second axis) that sequence slot ``slot`` owns: its open block, its ring
        blocks; None for a pool tensor addressed by the block tables."""
        if name.endswith("_tail"):
            return slice(slot, slot + 1)
        if name.endswith(RING):
            r = self.ring.ring_blocks
            return slice(slot * r, (slot + 1) * r)
        return None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def write_new_rows(self, batch: StepBatch, out: StepOutput) -> list[int]:
        """Copy each sequence's new rows into its open block, sealing every open block that becomes full on the way
        (a step across blocks -- an engine with ``cross_blocks`` -- fills and seals several, in order). A block the
        step sealed itself (``out.sealed``) is stored with the step's codes, not quantized again.

        Returns the indices (into the batch) of the sequences that sealed a block.
        """
        bs = self.block_size
        in_place = self.sealer.seals_in_place(self)  # a seal kernel writes each full open block into its pool block
        sealed: list[int] = []
        ctx = batch.context_lens.tolist()
        new = batch.new_lens.tolist()
        slots = batch.slot_ids.tolist()
        k_tail, v_tail = self.tensors["k_tail"], self.tensors["v_tail"]
        filled: list[tuple[int, int, int, torch.Tensor, torch.Tensor]] = []  # blocks to seal: slot, pool block, index, rows
        stored: list[tuple[int, int, int, int]] = []  # blocks the step sealed: slot, pool block, index, place in out.sealed
        for b in range(batch.batch_size):
            c, n, s = ctx[b], new[b], slots[b]
            done = 0
            while done < n:  # one piece per block the rows reach
                off = (c + done) % bs
                m = min(n - done, bs - off)
                # new_k [L, B, T, H, D] -> tail [L, S, H, bs, D]
                k_tail[:, s, :, off : off + m] = out.new_k[:, b, done : done + m].transpose(1, 2).to(k_tail.dtype)
                v_tail[:, s, :, off : off + m] = out.new_v[:, b, done : done + m].transpose(1, 2).to(v_tail.dtype)
                done += m
                if off + m == bs:
                    idx = (c + done) // bs - 1
                    if idx >= batch.block_tables.shape[1] or int(batch.block_tables[b, idx]) < 0:
                        raise TrtkvError(
                            f"sequence {b} fills its open block at {c + done} tokens but its block table has no block at index {idx}",
                            "allocate the block that receives the sealed block before the step",
                        )
                    at = None if out.sealed is None or in_place else out.sealed.position(b, idx)
                    if at is not None:
                        if idx == 0 and self.layout.sink_tokens:  # its sink rows, before the next piece reuses the open block
                            self.keep_sink_rows(s)
                        stored.append((s, int(batch.block_tables[b, idx]), idx, at))
                    elif in_place:
                        self.sealer.seal_in_place(self, s, int(batch.block_tables[b, idx]), idx)
                    else:  # the block's rows as they are now (the next piece reuses the open block): sealed below, together
                        filled.append((s, int(batch.block_tables[b, idx]), idx, k_tail[:, s, :, :bs].clone(), v_tail[:, s, :, :bs].clone()))
                    if not sealed or sealed[-1] != b:
                        sealed.append(b)
        if stored:
            self.store_sealed(stored, out.sealed)
        if filled:
            self.seal_rows(filled)
        return sealed

    def keep_sink_rows(self, slot: int) -> None:
        """Copy the first ``sink_tokens`` rows of ``slot``'s full open block -- its sequence's first block -- into the
        slot's sink rows in every layer (what sealing a first block keeps in fp16, ``cache_layout.sealing``)."""
        sink = self.layout.sink_tokens
        for layer in range(self.num_layers):
            lay = self.layout_of(layer)
            for which in ("k", "v"):
                tail = self.pool(layer, which).tail
                lay.sink_rows(tail[slot]).copy_(tail[slot, :, :sink])

    def store_sealed(self, stored: list[tuple[int, int, int, int]], seals: StepSeals) -> None:
        """Store blocks the step sealed itself -- ``(slot, pool block, block index, place in seals)`` -- with the
        step's codes (``StepSeals``): one copy per layer and K / V, no quantization."""
        at = torch.tensor([a for _, _, _, a in stored])
        for layer in range(self.num_layers):
            targets = torch.tensor([self.seal_target(layer, s, blk, idx) for s, blk, idx, _ in stored])
            for which in ("k", "v"):
                qt = seals.blocks[(layer, which)]
                picked = QuantizedTensor(**{f.name: None if (t := getattr(qt, f.name)) is None else t.index_select(0, at)
                                            for f in dataclasses.fields(qt)})
                store_quantized(self.pool(layer, which), targets, picked, self.layout_of(layer).tensor_format(which))

    def seal_rows(self, filled: list[tuple[int, int, int, torch.Tensor, torch.Tensor]]) -> None:
        """Seal full blocks given by their rows -- ``(slot, pool block, block index, k rows, v rows)``, the rows
        ``[L, H, block_size, D]`` fp16 as the open block held them -- with one quantization per layer and K / V for all
        of them (the sealer's ``quantize_blocks``), and a first block's sink rows into its slot (``cache_layout.sealing``)."""
        if len(filled) > 1 and any(len({self.seal_target(layer, s, blk, idx) for s, blk, idx, _, _ in filled}) < len(filled)
                                   for layer in range(self.num_layers)):
            for item in filled:  # one ring block twice: sealed in order, the later block wins
                self.seal_rows([item])
            return
        sink = self.layout.sink_tokens
        for layer in range(self.num_layers):
            lay = self.layout_of(layer)
            targets = torch.tensor([self.seal_target(layer, s, blk, idx) for s, blk, idx, _, _ in filled])
            for w, which in enumerate(("k", "v")):
                pool = self.pool(layer, which)
                rows = torch.stack([f[3 + w][layer] for f in filled]).float()  # [n, H, bs, D]
                for i, (s, _, idx, _, _) in enumerate(filled):
                    quantized, sink_rows = sealing(rows[i], idx, sink)
                    if sink_rows is not None:
                        lay.sink_rows(pool.tail[s]).copy_(sink_rows)
                        rows[i] = quantized
                first = torch.tensor([idx * self.block_size for _, _, idx, _, _ in filled])
                store_quantized(pool, targets, self.sealer.quantize_blocks(self, layer, which, rows, first), lay.tensor_format(which))

    def use_model_rope(self, model) -> None:
        """Take ``model``'s RoPE tables (``trtkv.rope.RopeTable.per_layer``) where the format keeps keys before RoPE and
        none were given yet: the engine stepping this cache hands them over, for its reads and the pool's seals."""
        if self.ropes is None and self.layout.fmt.needs_rope:
            ropes = RopeTable.per_layer(model)
            if len(ropes) != self.num_layers:
                raise TrtkvError(f"the model has {len(ropes)} layers and this cache {self.num_layers}", "step the cache with its own engine's model")
            self.ropes = ropes

    def rope_for(self, layer: int, tf) -> RopeTable | None:
        """The RoPE table reads and seals of ``layer``'s tensor format ``tf`` need (None: not ``prerope``); refused when
        not handed over."""
        if not tf.pre_rope:
            return None
        if self.ropes is None:
            raise TrtkvError(f"keys stored before RoPE ({tf.short()}) are sealed with the model's RoPE tables, which this cache was not given",
                             "step the cache with the torch engine, or call PagedKVCache.use_model_rope(model)")
        return self.ropes[layer]

    def seal(self, slot: int, block: int, block_index: int) -> None:
        """Seal open block ``slot`` of every layer -- its sequence's block ``block_index`` -- into pool block ``block``
        (a first block also fills the slot's sink rows; a ringed layer seals into its ring block instead)."""
        if self.sealer.seals_in_place(self):
            self.sealer.seal_in_place(self, slot, block, block_index)
            return
        bs = self.block_size
        self.seal_rows([(slot, block, block_index, self.tensors["k_tail"][:, slot, :, :bs].clone(), self.tensors["v_tail"][:, slot, :, :bs].clone())])

    def seal_target(self, layer: int, slot: int, block: int, block_index: int) -> int:
        """The block of ``layer``'s pool that a seal of pool block ``block`` (the sequence's ``block_index``) writes."""
        return self.ring.block(slot, block_index) if self.is_ringed(layer) else block
