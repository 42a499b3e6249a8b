"""Shared fixtures.

* ``builtin_model`` (session): the real SmolLM2-135M (builtin alias), fp32 on CPU, loaded once.
  The first run in a fresh ``$TRTKV_CACHE`` converts the GGUF (~25 s); later runs load the cached
  checkpoint (~3 s).
* ``tiny_model`` (factory): ``tiny_model(arch="mistral", with_tokenizer=False, **config)`` builds a
  small random model of a family of the family table (``arch``: its row's name in ``trtkv.families.FAMILIES``: Llama /
  Mistral / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 (text) / Phi-3), saves it to a fresh tmp directory and returns
  ``(directory, in_memory_model)``. Default dims are deliberately odd: 2 layers, 4 heads, 2 KV
  heads, head_dim 24, hidden 80 (so head_dim != hidden / heads), vocab 320. For tests that change
  the directory or the model.
* ``tiny_models`` (session cache): the same call, built once per distinct arguments for the whole
  session; the directory and the model are shared, so treat both as read-only.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# `make test` runs `pytest -n 2 --dist loadfile --no-loadscope-reorder`: a long module that starts last is the whole
# run's tail, so the longest (by their summed test times on 2 cores, 2026-12-06) are handed out first; the order inside
# a module is kept. Without --no-loadscope-reorder pytest-xdist hands out the modules with the most tests first instead,
# which put these last (a 70 s tail).
LONG_MODULES_FIRST = ("test_kernels.py", "test_serve.py", "test_serve_faults.py", "test_families.py", "test_build_engine.py",
                      "test_families_served.py", "test_torch_engine.py", "test_codebooks_outliers.py", "test_openai.py",
                      "test_bench_capacity_ceiling.py", "test_gpu_engine_dry_run.py", "test_presets_families.py", "test_plugin_contract.py",
                      "test_models.py")


@pytest.fixture(autouse=True, scope="session")
def _workers_share_the_cores():
    """`make test`'s workers split the machine: the runtime runs a CPU step on every core the process may use
    (``llm_engine.usable_cores``), and two workers doing that on 2 cores ran 4 threads on 2 (a greedy decode test went from under 12 s to 60 s),
    so each in-process runtime is told its share. Servers and CLI runs in subprocesses keep every core."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        yield
        return
    from trtkv.runtime import llm_engine

    share = max(1, llm_engine.usable_cores() // workers)
    patch = pytest.MonkeyPatch()
    patch.setattr(llm_engine, "usable_cores", lambda: share)
    yield
    patch.undo()


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONG_MODULES_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))


TINY_TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.\n"
    "def f(x):\n    return x * 2  # doubles\n"
    "Sphinx of black quartz, judge my vow! 0123456789 {}[]()<>=+-*/\n"
)

# families whose config's default token ids fall outside the tiny vocabulary get these
_TINY_TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
_TOKEN_IDS_OUTSIDE_THE_VOCABULARY = ("phi3", "gemma2", "gemma3")


def build_tiny_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on a few lines; eos is ``<eos>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator([TINY_TEXT] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")


def calibration_free(name: str, head_dim: int):
    """The calibration-free 3- or 2-bit layout (``trtkv.formats.CALIBRATION_FREE``, what the int3 / int2 names stored
    before they became the calibrated presets; every engine path reads it) fitted to ``head_dim`` as a preset would be
    (``fit_format``: int3's value groups of 32 become a divisor of it)."""
    from trtkv.formats import CALIBRATION_FREE, fit_format, get_format

    fmt, note = fit_format(get_format(CALIBRATION_FREE[name]), head_dim)
    assert fmt is not None, note
    return fmt.model_copy(update={"name": fmt.spec(), "description": ""})  # named by its spec string, as a written spec is


def random_kv_params(fmt, heads: int, head_dim: int, layers: int, seed: int, key_books_per_layer: bool = False) -> list:
    """Calibration constants a test can make up for ``fmt`` (a ``KVFormat``): smoothing factors in [0.5, 1.5) where a side
    smooths, sorted random levels where it decodes through a codebook (per KV head; the keys' one per layer with
    ``key_books_per_layer``); one ``LayerParams`` per layer."""
    from trtkv.artifacts import LayerParams
    from trtkv.quant import TensorParams

    g = torch.Generator().manual_seed(seed)

    def tensor(tf, per_layer: bool):
        book = torch.sort(torch.randn(tf.codebook_levels if per_layer else (heads, tf.codebook_levels), generator=g) * 1.5, -1).values
        return TensorParams(smooth=torch.rand(heads, head_dim, generator=g) + 0.5 if tf.smooth else None, codebook=book if tf.codebook else None,
                            bits=random_widths(tf, heads, head_dim, g) if tf.allocated_bits is not None else None)

    return [LayerParams(k=tensor(fmt.k, key_books_per_layer), v=tensor(fmt.v, False)) for _ in range(layers)]


def random_widths(tf, heads: int, head_dim: int, g: torch.Generator) -> torch.Tensor:
    """Random per-channel code widths [heads, head_dim] an ``allocB`` format ``tf`` may take (``plugins.cases.case_widths``:
    head 0 with every width once, the rest random within the row's bits)."""
    from trtkv.plugins.cases import case_widths

    return case_widths(tf, heads, head_dim, g)


def naive_mse_range(col: torch.Tensor, qmax: int) -> tuple[float, float, float]:
    """``(error, scale, zero)`` of the CLIP_GRID shrink of ``col``'s [min, max] (float64 values of one channel of a block)
    whose asymmetric codes come back nearest ``col`` in squared error, fp16 scale and zero as stored; ties keep the wider
    range -- the ``:mse`` block-channel search written as a plain loop."""
    from trtkv.formats import CLIP_GRID

    mn, mx = col.min().item(), col.max().item()
    best = None
    for clip in CLIP_GRID:
        zero = float(torch.tensor(mn + (mx - mn) * (1 - clip) / 2).half())
        scale = float(torch.tensor((mx - mn) * clip / qmax).half())
        q = ((col - zero) / scale).round().clamp(0, qmax) if scale > 0 else torch.zeros_like(col)
        err = ((q * scale + zero - col) ** 2).sum().item()
        if best is None or err < best[0] - 1e-9:
            best = (err, scale, zero)
    return best


def build_tiny_model(
    directory: Path, arch: str = "mistral", *, with_tokenizer: bool = False, seed: int = 0, **overrides
):
    """Save a small random model of the family ``arch`` (its row in ``trtkv.families.FAMILIES``: the config class of its
    model_type, its first architecture) to ``directory``; return the in-memory model (fp32, eval)."""
    import transformers

    from trtkv.families import FAMILIES

    family = FAMILIES[arch]
    kw = dict(
        vocab_size=320, hidden_size=80, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=256, tie_word_embeddings=False,
    )
    if arch == "llama":  # llama derives head_dim from hidden / heads unless given: exercise that path
        kw.update(hidden_size=96)
        kw.pop("head_dim")
    if arch == "mistral":
        kw.update(sliding_window=None)
    if arch in _TOKEN_IDS_OUTSIDE_THE_VOCABULARY:
        kw.update(_TINY_TOKEN_IDS)
    kw.update(overrides)
    attn = kw.pop("attn_implementation", "eager" if family.eager_only else "sdpa")
    config = transformers.AutoConfig.for_model(family.model_type, **kw)
    torch.manual_seed(seed)
    model = getattr(transformers, family.architectures[0])(config).eval()
    model.config._attn_implementation = attn
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory))
    if with_tokenizer:
        build_tiny_tokenizer(min(320, config.vocab_size)).save_pretrained(str(directory))
    return model


@pytest.fixture
def tiny_model(tmp_path):
    """Factory: ``tiny_model(arch="mistral", with_tokenizer=False, **config) -> (dir, model)``."""
    counter = iter(range(1000))

    def make(arch: str = "mistral", **kw):
        d = tmp_path / f"tiny-{arch}-{next(counter)}"
        return d, build_tiny_model(d, arch, **kw)

    return make


@pytest.fixture(scope="session")
def builtin_model():
    """The real SmolLM2-135M, fp32 on CPU, loaded once per test session."""
    from trtkv.models import load_model

    return load_model("smollm2-135m", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Session cache: ``tiny_models(arch="mistral", with_tokenizer=False, seed=0, **config) -> (dir, model)``,
    built once per distinct arguments and shared by every module that asks (read-only)."""
    built: dict = {}

    def get(arch: str = "mistral", *, with_tokenizer: bool = False, seed: int = 0, **config):
        key = (arch, with_tokenizer, seed, tuple(sorted(config.items())))
        if key not in built:
            d = tmp_path_factory.mktemp(f"tiny-{arch}") / "model"
            built[key] = (d, build_tiny_model(d, arch, with_tokenizer=with_tokenizer, seed=seed, **config))
        return built[key]

    return get


# The model families of tests/test_families.py (also served, and run over a window ring, by other test files).
WINDOW = 8
# family -> (conftest arch, config overrides). Chosen so that every one also round-trips through GGUF: transformers'
# GGUF loader takes Qwen3's head_dim from its default (128) and Phi-3's from hidden / heads, and Gemma ties embeddings.
FAMILIES = {
    "qwen3": ("qwen3", dict(head_dim=128)),
    "gemma2": ("gemma2", dict(sliding_window=WINDOW, tie_word_embeddings=True, query_pre_attn_scalar=20,
                              attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("gemma3", dict(sliding_window=WINDOW, tie_word_embeddings=True, num_hidden_layers=6, hidden_size=64,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=64)),
    "phi3": ("phi3", dict(hidden_size=96)),
    "mistral-sw": ("mistral", dict(sliding_window=WINDOW)),
    "qwen2-sw": ("qwen2", dict(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1)),
}


@pytest.fixture(scope="session")
def family(tiny_models):
    """``family(name) -> (dir, model)``: the tiny model of ``FAMILIES[name]`` with a tokenizer (built once per session)."""

    def get(name: str):
        arch, kw = FAMILIES[name]
        return tiny_models(arch, with_tokenizer=True, **kw)

    return get


SMALL_LLAMA = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32)  # inside the kernels' limits


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls: one thread is faster than an OpenMP pool on a shared machine (use from a module's autouse fixture)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tokenizer():
    """The tiny byte-level BPE tokenizer (``build_tiny_tokenizer``), built once."""
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def small_llama(tiny_models):
    """A tiny random Llama inside the kernels' limits (``SMALL_LLAMA``), shared read-only by the runtime tests."""
    return tiny_models("llama", **SMALL_LLAMA)[1]
