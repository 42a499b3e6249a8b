"""The public interface of the generated repository: TensorRT-LLM's Triton ``ensemble`` inputs and outputs.

Names, dtypes and dims follow tensorrtllm_backend's ``all_models/inflight_batcher_llm/ensemble``
(the last version before the backend files moved to the TensorRT-LLM repository), so existing clients,
the ``/v2/models/ensemble/generate`` endpoints and Triton's benchmarking tools work unchanged. Dims
exclude the batch dimension (``max_batch_size > 0``). ``seed`` and ``min_tokens`` are the newer
spellings of ``random_seed`` and ``min_length``; both are accepted.

``SUPPORTED`` marks how trtkv treats each input: ``used`` (implemented), ``neutral`` (accepted; any
value other than the neutral one is refused with a clear message).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # Triton TYPE_* without the prefix
    dims: tuple[int, ...]
    optional: bool = True
    support: str = "used"  # used | neutral
    neutral: object = None  # the value that means "off" for neutral inputs
    doc: str = ""


INPUTS: tuple[Tensor, ...] = (
    Tensor("text_input", "STRING", (1,), optional=False, doc="the prompt"),
    Tensor("max_tokens", "INT32", (1,), optional=False, doc="new tokens to generate (>= 1)"),
    Tensor("bad_words", "STRING", (-1,), doc="words never completed (matched as token sequences: the last token is banned after the others)"),
    Tensor("stop_words", "STRING", (-1,), doc="generation stops when the text ends with one; it is cut from the output"),
    Tensor("exclude_input_in_output", "BOOL", (1,), doc="non-streaming: return only the new text (default: prompt + new text)"),
    Tensor("end_id", "INT32", (1,), doc="end-of-sequence token id (default: the tokenizer's)"),
    Tensor("pad_id", "INT32", (1,), doc="accepted; outputs are text, nothing is padded"),
    Tensor("top_k", "INT32", (1,), doc="0: off (with no other sampling input: greedy)"),
    Tensor("top_p", "FP32", (1,), doc="0 or 1.0: off"),
    Tensor("temperature", "FP32", (1,), doc="0: greedy. A request samples when it gives temperature > 0, top_k > 1 or 0 < top_p < 1; else greedy"),
    Tensor("length_penalty", "FP32", (1,), support="neutral", neutral=1.0, doc="beam search only"),
    Tensor("repetition_penalty", "FP32", (1,), support="neutral", neutral=1.0),
    Tensor("min_length", "INT32", (1,), doc="end_id and stop words are suppressed until this many new tokens"),
    Tensor("min_tokens", "INT32", (1,), doc="newer name of min_length"),
    Tensor("presence_penalty", "FP32", (1,), support="neutral", neutral=0.0),
    Tensor("frequency_penalty", "FP32", (1,), support="neutral", neutral=0.0),
    Tensor("random_seed", "UINT64", (1,), doc="reproducible sampling per request"),
    Tensor("seed", "UINT64", (1,), doc="newer name of random_seed"),
    Tensor("return_log_probs", "BOOL", (1,), doc="fill cum_log_probs / output_log_probs"),
    Tensor("return_context_logits", "BOOL", (1,), support="neutral", neutral=False),
    Tensor("return_generation_logits", "BOOL", (1,), support="neutral", neutral=False),
    Tensor("beam_width", "INT32", (1,), support="neutral", neutral=1, doc="only 1 (no beam search)"),
    Tensor("num_return_sequences", "INT32", (1,), support="neutral", neutral=1),
    Tensor("stream", "BOOL", (1,), doc="one response per token (decoupled)"),
)

OUTPUTS: tuple[Tensor, ...] = (
    Tensor("text_output", "STRING", (-1,), optional=False, doc="streaming: the new text of this response; else the whole text"),
    Tensor("cum_log_probs", "FP32", (-1,), optional=False, doc="sum of the sampled tokens' log-probabilities (0 unless return_log_probs)"),
    Tensor("output_log_probs", "FP32", (-1, -1), optional=False, doc="per-token log-probabilities (empty unless return_log_probs)"),
)

INPUT_BY_NAME = {t.name: t for t in INPUTS}

# Custom metric families the python-backend model exports (and the Kubernetes autoscaler rules read).
KV_BLOCKS_METRIC = "trtkv_kv_blocks"  # gauge, label state=used|free
