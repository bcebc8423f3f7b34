"""The scheduler (rows joining and leaving) and the model runner: the in-place KV cache, fixed-shape forwards,
CUDA-graph storage and the attention mask (jfcore/decoding/scheduler.py, jfcore/decoding/runner/)."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

from jfcore.config import ConfigError
from jfcore.decoding import DecodeConfig
from jfcore.decoding.decoder import Decoder
from jfcore.decoding.rules.layout import tree_mask
from jfcore.decoding.runner.compiled import InductorForward
from jfcore.decoding.runner.graphs import GraphForward
from jfcore.decoding.runner.kv_cache import GRANULE, SlotCache, SlotLayer, shape_bucket
from jfcore.decoding.runner.slots import SlotBatch, left_pad
from jfcore.decoding.scheduler import fill_from_the_end
from tests.support.tiny_models import greedy_reference, tiny_model


@pytest.mark.parametrize("rules", ["native", "python"])
def test_rows_stream_their_tokens_as_they_are_committed(rules):
    """Every row's `out` grows step by step to its greedy continuation (a server streams it), also for rows that
    join a running batch, with either rules."""
    m = tiny_model("llama")
    config = DecodeConfig(block_size=4, max_new_tokens=20)
    live = Decoder(m, config, [], 0, rules=rules).scheduler()
    first = live.add([[5, 6, 7]])
    seen = {id(first[0]): [list(first[0].out)]}
    joined = []
    for step in range(40):
        if step == 2:
            joined = live.add([[9, 1], [4]])
            seen.update({id(r): [list(r.out)] for r in joined})
        if not live.rows:
            break
        rows = list(live.rows)
        live.step()
        for row in rows:
            seen[id(row)].append(list(row.out))
    for row, prompt in [(first[0], [5, 6, 7]), (joined[0], [9, 1]), (joined[1], [4])]:
        final = greedy_reference(m, prompt, 20)
        assert row.finished and row.out == final
        history = seen[id(row)]
        assert all(final[: len(h)] == h for h in history)  # every snapshot is a prefix
        assert len({len(h) for h in history}) > 2  # and it grew over several steps, not only at the end
        assert row.forwards == len(history) - 1


def _forward(m, cache, tokens, start, mask):
    positions = torch.arange(start, start + tokens.shape[1]).expand(tokens.shape[0], -1)
    return m(
        input_ids=tokens, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True
    ).logits


@torch.inference_mode()
def test_in_place_cache_equals_the_dynamic_cache_through_growth_crop_and_row_selection():
    m = tiny_model("llama")
    slot, dynamic = SlotCache(m.config), DynamicCache(config=m.config)
    gen = torch.Generator().manual_seed(0)
    length = GRANULE - 5  # the first steps cross the first granule: storage grows
    prompt = torch.randint(1, 96, (3, length), generator=gen)
    mask = torch.ones(3, length, dtype=torch.long)
    torch.testing.assert_close(_forward(m, slot, prompt, 0, mask), _forward(m, dynamic, prompt, 0, mask))
    for step in range(6):
        draft = torch.randint(1, 96, (mask.shape[0], 8), generator=gen)
        mask = torch.cat([mask, torch.ones_like(draft)], dim=1)
        torch.testing.assert_close(_forward(m, slot, draft, length, mask), _forward(m, dynamic, draft, length, mask))
        written = length + 8
        drop = step % 4  # keep 8 - drop of the new slots
        slot.crop(-drop)
        dynamic.crop(-drop)
        mask = mask[:, : mask.shape[1] - drop]
        length += 8 - drop
        if step == 3:  # a row leaves
            index = torch.tensor([0, 2])
            slot.batch_select_indices(index)
            dynamic.batch_select_indices(index)
            mask = mask[index]
    assert all(isinstance(layer, SlotLayer) for layer in slot.layers)
    assert slot.get_seq_length() == dynamic.get_seq_length() == length
    assert slot.layers[0]._k.shape[2] >= 2 * GRANULE  # it grew, and holds room to spare
    # Slots never written are zeros: a fixed-shape read covers them, and garbage (NaN) there would poison attention.
    assert all(not layer._k[:, :, written:].any() and not layer._v[:, :, written:].any() for layer in slot.layers)
    for a, b in zip(slot.layers, dynamic.layers):
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)


_WRITE_SOURCE = {"copy_": 1, "index_put_": 2, "index_copy_": 3}  # in-place copies: the argument written


class _WrittenBytes(TorchDispatchMode):
    """Counts the bytes operations write: every new tensor an operation makes, and what an in-place copy writes
    into its target (views write nothing)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _WRITE_SOURCE:
            self.count += args[_WRITE_SOURCE[name]].nbytes
        elif not func.is_view and isinstance(out, torch.Tensor):
            self.count += out.nbytes
        return out


def _prefilled(m, prompts: list[list[int]]) -> SlotBatch:
    batch = SlotBatch(m, len(prompts))
    tokens, valid, positions = left_pad(prompts, 0)
    batch.forward(tokens, valid, positions)
    batch.keep(valid)
    return batch


def _rows_kv(batch: SlotBatch) -> list[list[torch.Tensor]]:
    """Each row's keys and values over its valid slots, every layer."""
    return [
        [t[b][:, batch.valid[b]] for layer in batch.cache.layers for t in (layer.keys, layer.values)]
        for b in range(batch.valid.shape[0])
    ]


@torch.inference_mode()
def test_rows_leave_and_join_without_copying_the_other_rows():
    m = tiny_model("llama")
    gen = random.Random(0)
    batch = _prefilled(m, [[gen.randrange(1, 96) for _ in range(20)] for _ in range(8)])
    before, storage = _rows_kv(batch), batch.cache.storage_key
    one_row = sum(t.nbytes for t in before[0])

    with _WrittenBytes() as written:  # rows 2 and 5 leave: rows 6 and 7 take their places
        keep = fill_from_the_end(8, {2, 5})
        batch.select_rows(keep)
    assert keep == [0, 1, 6, 3, 4, 7]
    # Two rows moved, each read into a temporary and written (4 rows' bytes); moving the six that stay would be 12.
    assert written.count < 5 * one_row, (written.count, one_row)
    assert all(torch.equal(a, b) for i, row in zip(keep, _rows_kv(batch)) for a, b in zip(before[i], row))

    newcomer = _prefilled(m, [[gen.randrange(1, 96) for _ in range(28)]])  # more slots than the batch has
    joining = _rows_kv(newcomer)[0]
    with _WrittenBytes() as written:
        batch.extend(newcomer)
    assert written.count < 1.5 * sum(t.nbytes for t in joining), written.count  # the newcomer's slots only
    assert batch.cache.storage_key == storage  # nothing was reallocated
    after = _rows_kv(batch)
    assert all(torch.equal(a, b) for i, row in zip(keep, after) for a, b in zip(before[i], row))
    assert all(torch.equal(a, b) for a, b in zip(joining, after[-1]))


@pytest.mark.parametrize("fixed", ["padded widths", "graph buffers"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_fixed_shape_forwards_are_exact(arch, fixed):
    """The fixed-shape path's mechanics, run eagerly: queries padded to a bucket, the cache read in whole
    granules through a position tensor, 4D masks, padding slots cropped; and for CUDA graphs (`capture=False`: the
    forward runs on the static buffers instead of replaying) rows padded to a bucket, inputs copied into static
    buffers, rows leaving and the cache growing under the graphs. Every method still gives `generate`'s tokens,
    and prompts long enough to cross a granule do too."""
    m = tiny_model(arch)
    rng = random.Random(arch)
    configs = [
        DecodeConfig(method="ar", max_new_tokens=20),
        DecodeConfig(method="jacobi", block_size=5, max_new_tokens=20),
        DecodeConfig(method="jacobi", block_size=3, max_new_tokens=20, lookup_tokens=3),
        DecodeConfig(method="multiblock", block_size=3, num_blocks=2, pool_size=2, ngram_size=3, max_new_tokens=20),
    ]
    widths: list[int] = []
    for config in configs:
        prompts = [[rng.randrange(1, 96) for _ in range(n)] for n in (3, GRANULE - 10, 7)]
        budgets = [20, 12, 5]  # rows leave at different steps: the padded batch shrinks 4 -> 2 -> 1
        decoder = Decoder(m, config, [], 0, on_step=lambda event: widths.append(max(event.widths)))
        decoder.runner.fixed_forward = (
            InductorForward(m, module=m) if fixed == "padded widths" else GraphForward(m, False)
        )
        live = decoder.scheduler()
        rows = live.add(prompts, budgets)
        live.step()
        live.step()
        prompts, budgets = prompts + [[9, 4, 4, 1]], budgets + [9]
        rows += live.add(prompts[-1:], budgets[-1:])  # a row joins: the batch's storage grows under the graphs
        while live.rows:
            live.step()
        out = [row.out for row in rows]
        assert out == [greedy_reference(m, p, n) for p, n in zip(prompts, budgets)], config.describe()
    assert any(w & (w - 1) for w in widths)  # some forwards really were padded (a width not a power of two)


def test_shapes_are_padded_to_the_nearest_bucket():
    """Buckets are the powers of two and 1.5 times them; each size pads to the smallest bucket that holds it."""
    buckets = sorted({m << k for m in (1, 3) for k in range(14)} - {0})
    for n in range(1, 4097):
        assert shape_bucket(n) == next(b for b in buckets if b >= n)
    assert shape_bucket(40) == 48 and shape_bucket(49) == 64


def test_a_new_decode_moves_into_the_graphs_storage_only_once_the_old_cache_is_gone():
    """One CUDA-graph runner serves every decode of a model: a decode that starts after the last one ended moves
    its cache into the storage the graphs were captured on (so they stay valid), while a decode that starts beside
    a live one keeps its own storage. Both give `generate`'s tokens (`capture=False`: run on the static buffers)."""
    m = tiny_model("llama")
    runner = GraphForward(m, capture=False)
    config = DecodeConfig(method="jacobi", block_size=4, max_new_tokens=12)
    prompts = [[5, 9, 2, 7], [3, 3, 8], [11, 4, 6, 1, 2]]

    def start(prompt):
        decoder = Decoder(m, config, [], 0)
        decoder.runner.fixed_forward = runner
        live = decoder.scheduler()
        return live, live.add([prompt])[0]

    live, row = start(prompts[0])
    while live.rows:
        live.step()
    first_storage = runner.storage
    del live  # the first decode's cache is gone: the next decode adopts its storage
    later, later_row = start(prompts[1])
    later.step()
    assert (runner.adoptions, runner.storage) == (1, first_storage)
    beside, beside_row = start(prompts[2])  # `later` is alive: its storage is not for taking
    beside.step()
    assert (runner.adoptions, runner.storage != first_storage) == (1, True)
    while later.rows or beside.rows:  # taking turns, each retires the other's graphs (and adopts once it is gone)
        for batch in (later, beside):
            if batch.rows:
                batch.step()
    for r, prompt in ((row, prompts[0]), (later_row, prompts[1]), (beside_row, prompts[2])):
        assert r.out == greedy_reference(m, prompt, 12)


@pytest.mark.parametrize("with_tree", [True, False])
def test_the_attention_mask_is_built_on_the_models_device(with_tree):
    """On a GPU only the booleans it is made of cross from the host (the tree of candidates is built on the device
    already). On the meta device any tensor left on the host fails, so this checks the devices without a GPU: the
    tree, and the mask from host row state, a device tree (or none: causal), at a fixed shape's wider view."""
    meta = torch.device("meta")
    tree = tree_mask(torch.tensor([[0, 1, 1], [0, 1, 0]]), meta)  # a draft of 1, two candidates of 1; a draft of 2
    assert tree.device == meta and tree.shape == (2, 3, 3)
    batch = _prefilled(tiny_model("llama"), [[3, 4, 5], [6, 7]])
    batch.device = meta
    batch._new = batch.num_slots
    batch._append(torch.tensor([[True, True, True], [True, True, False]]))
    query_valid = torch.tensor([[True, True, True], [True, True, False]])
    mask = batch._mask(query_valid, tree if with_tree else None, view=batch.num_slots + 5)
    assert mask.device == meta and mask.shape == (2, 1, 3, batch.num_slots + 5)


def test_cuda_graphs_on_a_cpu_model_say_what_to_use_instead():
    config = DecodeConfig(method="jacobi", block_size=4, max_new_tokens=4, compile="cuda_graphs")
    with pytest.raises(ConfigError, match="needs the model on a CUDA device, and it is on cpu: use compile='inductor'"):
        Decoder(tiny_model("llama"), config, [], 0)


def test_inductor_compiled_decoding_is_greedy():
    """compile='inductor' end to end on a tiny model: the compiled forwards (widths 4, 2 and 1) give `generate`'s
    tokens."""
    m = tiny_model("llama")
    prompt = [5, 9, 2, 7]
    config = DecodeConfig(method="jacobi", block_size=4, max_new_tokens=12, compile="inductor")
    assert Decoder(m, config, [], 0).decode([prompt]).sequences == [greedy_reference(m, prompt, 12)]
