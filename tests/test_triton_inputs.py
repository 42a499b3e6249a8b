"""Request parsing of the Triton model (triton_repo/inputs.py), input by input: each input tensor of the ensemble
interface -> the ``ParsedRequest`` and the whole ``SamplingParams`` that reach the engine (compared as one object, so a
dropped or extra field fails), its default, its edges and its bad values (a ``TrtkvError`` naming it, which the model
sends back as a 400). And the interface table itself (interface.py) against TensorRT-LLM's ensemble and the
documented neutral values.

``end_id`` outside the vocabulary is refused where the vocabulary is known (``LLMEngine.make_sequence``,
tests/test_runtime_edges.py). The rules are interface.py's docs: "a request samples when it gives temperature > 0, top_k > 1 or 0 < top_p < 1;
else greedy", "top_p 0 or 1.0: off", "top_k 0: off", ``seed`` / ``min_tokens`` are the newer names of
``random_seed`` / ``min_length`` (the newer wins), empty words mean none, neutral inputs accept only their neutral value.
"""

from __future__ import annotations

import numpy as np
import pytest

from trtkv.errors import TrtkvError
from trtkv.runtime.sequence import SamplingParams
from trtkv.triton_repo.inputs import MAX_TOKENS_LIMIT, ParsedRequest, parse_request
from trtkv.triton_repo.interface import INPUT_BY_NAME, INPUTS, KV_BLOCKS_METRIC, OUTPUTS

# numpy dtypes Triton hands the python model for each declared type
NP = {"STRING": object, "INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64, "BOOL": np.bool_}


def arr(name: str, value) -> np.ndarray:
    """An input as the python backend gives it: [1, n] (the batch dimension first) of the declared type."""
    dtype = NP[INPUT_BY_NAME[name].dtype]
    values = value if isinstance(value, list) else [value]
    if dtype is object:
        values = [v.encode() if isinstance(v, str) else v for v in values]
    return np.array([values], dtype=dtype)


def get_of(**inputs):
    def get(name):
        if name not in inputs:
            return None
        v = inputs[name]
        return v if isinstance(v, np.ndarray) else arr(name, v)

    return get


def parse(**inputs) -> ParsedRequest:
    return parse_request(get_of(**{"text_input": "hello", "max_tokens": 8, **inputs}))


def want(**changes) -> SamplingParams:
    """The params of a request with ``max_tokens`` 8 and nothing else (greedy), with ``changes``."""
    return SamplingParams(**{"max_tokens": 8, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": None, "end_id": None,
                             "min_tokens": 0, "stop_words": [], "bad_words": [], **changes})


def test_a_minimal_request_is_greedy_with_every_default():
    r = parse()
    assert r == ParsedRequest(prompt="hello", params=want(), stream=False, exclude_input_in_output=False, return_log_probs=False)
    assert r.params.greedy and r.params.stop_token_ids == [] and r.params.bad_token_ids == [] and r.params.ignore_eos is False


@pytest.mark.parametrize("inputs, params", [
    # temperature: 0 greedy, > 0 samples at it
    ({"temperature": 0.0}, want()),
    ({"temperature": 0.5}, want(temperature=0.5)),
    ({"temperature": 1.0}, want(temperature=1.0)),
    ({"temperature": 1.75}, want(temperature=1.75)),
    # top_k: 0 off, 1 greedy, > 1 samples at temperature 1
    ({"top_k": 0}, want()),
    ({"top_k": 1}, want(top_k=1)),
    ({"top_k": 2}, want(temperature=1.0, top_k=2)),
    ({"top_k": 40, "temperature": 0.25}, want(temperature=0.25, top_k=40)),
    ({"top_k": 1, "temperature": 0.75}, want(temperature=0.75, top_k=1)),  # samples, but top_k 1 keeps one token
    ({"top_k": 5, "temperature": 0.0}, want(top_k=5)),  # an explicit temperature 0 is greedy, whatever top_k
    ({"top_p": 0.5, "temperature": 0.0}, want(top_p=0.5)),
    # top_p: 0 and 1 off, in between samples at temperature 1
    ({"top_p": 0.0}, want()),
    ({"top_p": 1.0}, want()),
    ({"top_p": 0.5}, want(temperature=1.0, top_p=0.5)),
    ({"top_p": 0.999}, want(temperature=1.0, top_p=pytest.approx(0.999))),
    ({"top_p": 0.25, "temperature": 0.5}, want(temperature=0.5, top_p=0.25)),
    ({"top_p": 0.0, "temperature": 0.5}, want(temperature=0.5)),
    # seeds: either name, the newer wins; masked to 63 bits
    ({"seed": 0}, want(seed=0)),
    ({"seed": 7}, want(seed=7)),
    ({"random_seed": 9}, want(seed=9)),
    ({"seed": 3, "random_seed": 9}, want(seed=3)),
    ({"seed": 2**64 - 1}, want(seed=2**63 - 1)),
    ({"seed": 2**63 + 5}, want(seed=5)),
    # min_tokens: either name, the newer wins
    ({"min_tokens": 0}, want()),
    ({"min_tokens": 3}, want(min_tokens=3)),
    ({"min_length": 2}, want(min_tokens=2)),
    ({"min_tokens": 4, "min_length": 2}, want(min_tokens=4)),
    ({"min_tokens": 0, "min_length": 2}, want(min_tokens=0)),
    ({"min_tokens": 8}, want(min_tokens=8)),
    # end_id
    ({"end_id": 0}, want(end_id=0)),
    ({"end_id": 17}, want(end_id=17)),
    # word lists: every element a word, empty ones dropped, order kept
    ({"stop_words": ["END"]}, want(stop_words=["END"])),
    ({"stop_words": ["\n\n", "END", "é"]}, want(stop_words=["\n\n", "END", "é"])),
    ({"stop_words": ["", "END", ""]}, want(stop_words=["END"])),
    ({"stop_words": [""]}, want()),
    ({"bad_words": ["bad", "worse"]}, want(bad_words=["bad", "worse"])),
    ({"bad_words": ["", "x"]}, want(bad_words=["x"])),
    ({"stop_words": ["s"], "bad_words": ["b"]}, want(stop_words=["s"], bad_words=["b"])),
    # max_tokens at its limits
    ({"max_tokens": 1}, want(max_tokens=1)),
    ({"max_tokens": MAX_TOKENS_LIMIT}, want(max_tokens=MAX_TOKENS_LIMIT)),
    # accepted and ignored
    ({"pad_id": 3}, want()),
    # neutral values are accepted
    ({"length_penalty": 1.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
      "return_context_logits": False, "return_generation_logits": False, "beam_width": 1, "num_return_sequences": 1}, want()),
])
def test_each_input_becomes_its_sampling_param(inputs, params):
    assert parse(**inputs).params == params


@pytest.mark.parametrize("text", [" ", "\n", " x ", "\t\tdef f():"])
def test_a_prompt_is_taken_as_it_is_spaces_included(text):
    assert parse(text_input=text).prompt == text


def test_words_arrive_as_a_2d_batch_of_any_length():
    words = np.array([[b"a", b"bb", b"", b"ccc"]], dtype=object)
    assert parse(stop_words=words).params.stop_words == ["a", "bb", "ccc"]
    words = np.array([[b"x"], [b"y"]], dtype=object)  # any shape: every element is a word
    assert parse(bad_words=words).params.bad_words == ["x", "y"]
    assert parse(stop_words=np.zeros((1, 0), dtype=object)).params.stop_words == []


def test_text_input_bytes_or_str_is_decoded_as_utf8():
    assert parse(text_input="héllo").prompt == "héllo"
    assert parse(text_input=np.array([["héllo".encode()]], dtype=object)).prompt == "héllo"
    assert parse(text_input=np.array([["plain str"]], dtype=object)).prompt == "plain str"
    assert parse(stop_words=np.array([["é".encode(), "ü"]], dtype=object)).params.stop_words == ["é", "ü"]


@pytest.mark.parametrize("name", ["stream", "exclude_input_in_output", "return_log_probs"])
@pytest.mark.parametrize("value", [True, False])
def test_each_flag_is_read_on_its_own(name, value):
    r = parse(**{name: value})
    flags = {"stream": r.stream, "exclude_input_in_output": r.exclude_input_in_output, "return_log_probs": r.return_log_probs}
    assert flags == {n: (value if n == name else False) for n in flags}
    assert r.params == want()  # a flag changes no sampling parameter


def test_all_flags_at_once():
    r = parse(stream=True, exclude_input_in_output=True, return_log_probs=True)
    assert (r.stream, r.exclude_input_in_output, r.return_log_probs) == (True, True, True)


@pytest.mark.parametrize("inputs, match", [
    ({"text_input": None}, "missing input 'text_input'"),
    ({"text_input": ""}, "text_input is empty"),
    ({"text_input": np.array([[b"\xff\xfe"]], dtype=object)}, "not valid UTF-8"),
    ({"stop_words": np.array([[b"ok", b"\xc3"]], dtype=object)}, "not valid UTF-8"),
    ({"max_tokens": None}, "missing input 'max_tokens'"),
    ({"max_tokens": 0}, f"max_tokens must be between 1 and {MAX_TOKENS_LIMIT}, got 0"),
    ({"max_tokens": -1}, "got -1"),
    ({"max_tokens": MAX_TOKENS_LIMIT + 1}, f"got {MAX_TOKENS_LIMIT + 1}"),
    ({"temperature": -0.01}, "temperature must be >= 0"),
    ({"temperature": -1.0, "top_k": 5}, "temperature must be >= 0"),
    ({"top_k": -1}, "top_k must be >= 0, got -1"),
    ({"top_p": 1.01}, "top_p must be in"),
    ({"top_p": -0.5}, "top_p must be in"),
    ({"min_tokens": -1}, "min_tokens must be >= 0"),
    ({"min_length": -2}, "min_tokens must be >= 0"),
    ({"min_tokens": 9}, r"min_tokens \(9\) is more than max_tokens \(8\)"),  # as the OpenAI front (and vLLM) refuse it
    ({"min_length": 20}, r"min_tokens \(20\) is more than max_tokens"),
    ({"temperature": float("nan")}, "temperature must be a finite number, got nan"),
    ({"temperature": float("inf")}, "temperature must be a finite number, got inf"),
    ({"top_p": float("nan")}, "top_p must be a finite number"),
    ({"top_p": float("-inf"), "temperature": 0.5}, "top_p must be a finite number"),
    ({"max_tokens": np.zeros((1, 0), dtype=np.int32)}, r"'max_tokens' must hold one value per request, got shape \[1, 0\]"),
    ({"max_tokens": np.array([[2, 3]], dtype=np.int32)}, r"'max_tokens' must hold one value per request, got shape \[1, 2\]"),
    ({"text_input": np.array([[b"a", b"b"]], dtype=object)}, "'text_input' must hold one value"),
    ({"temperature": np.array([[0.5, 0.5]], dtype=np.float32)}, "'temperature' must hold one value"),
    ({"seed": np.array([[1, 2]], dtype=np.uint64)}, "'seed' must hold one value"),
    ({"stream": np.array([[True, False]])}, "'stream' must hold one value"),
])
def test_each_bad_input_is_a_one_line_error_naming_it(inputs, match):
    full = {"text_input": "hello", "max_tokens": 8, **inputs}
    with pytest.raises(TrtkvError, match=match) as info:
        parse_request(get_of(**{k: v for k, v in full.items() if v is not None}))
    assert "\n" not in str(info.value)


NEUTRAL = {  # interface.py: accepted only at the value that means "off"
    "length_penalty": (1.0, 0.5), "repetition_penalty": (1.0, 1.2), "presence_penalty": (0.0, 0.5), "frequency_penalty": (0.0, -0.5),
    "return_context_logits": (False, True), "return_generation_logits": (False, True), "beam_width": (1, 2),
    "num_return_sequences": (1, 3),
}


@pytest.mark.parametrize("name", list(NEUTRAL))
def test_a_neutral_input_takes_only_its_neutral_value(name):
    neutral, other = NEUTRAL[name]
    assert parse(**{name: neutral}).params == want()
    with pytest.raises(TrtkvError, match=f"{name}=.* is not supported by trtkv \\(only {neutral!r}\\)"):
        parse(**{name: other})


def test_only_the_documented_inputs_are_neutral():
    assert {t.name for t in INPUTS if t.support == "neutral"} == set(NEUTRAL)
    assert {t.name: t.neutral for t in INPUTS if t.support == "neutral"} == {n: v[0] for n, v in NEUTRAL.items()}
    assert all(t.support == "used" for t in INPUTS if t.name not in NEUTRAL)


# TensorRT-LLM's ensemble inputs (tensorrtllm_backend all_models/inflight_batcher_llm/ensemble/config.pbtxt) plus the newer
# spellings seed / min_tokens and the neutral extras; dims without the batch dimension
INTERFACE = [
    ("text_input", "STRING", (1,), False), ("max_tokens", "INT32", (1,), False), ("bad_words", "STRING", (-1,), True),
    ("stop_words", "STRING", (-1,), True), ("exclude_input_in_output", "BOOL", (1,), True), ("end_id", "INT32", (1,), True),
    ("pad_id", "INT32", (1,), True), ("top_k", "INT32", (1,), True), ("top_p", "FP32", (1,), True), ("temperature", "FP32", (1,), True),
    ("length_penalty", "FP32", (1,), True), ("repetition_penalty", "FP32", (1,), True), ("min_length", "INT32", (1,), True),
    ("min_tokens", "INT32", (1,), True), ("presence_penalty", "FP32", (1,), True), ("frequency_penalty", "FP32", (1,), True),
    ("random_seed", "UINT64", (1,), True), ("seed", "UINT64", (1,), True), ("return_log_probs", "BOOL", (1,), True),
    ("return_context_logits", "BOOL", (1,), True), ("return_generation_logits", "BOOL", (1,), True), ("beam_width", "INT32", (1,), True),
    ("num_return_sequences", "INT32", (1,), True), ("stream", "BOOL", (1,), True),
]


def test_the_interface_table_is_tensorrt_llms_ensemble():
    assert [(t.name, t.dtype, t.dims, t.optional) for t in INPUTS] == INTERFACE
    assert [(t.name, t.dtype, t.dims, t.optional) for t in OUTPUTS] == [
        ("text_output", "STRING", (-1,), False), ("cum_log_probs", "FP32", (-1,), False), ("output_log_probs", "FP32", (-1, -1), False)]
    assert set(INPUT_BY_NAME) == {t[0] for t in INTERFACE} and all(INPUT_BY_NAME[t.name] is t for t in INPUTS)
    assert KV_BLOCKS_METRIC == "trtkv_kv_blocks"


def test_an_empty_input_tensor_is_a_400_naming_it():
    """An input with no value (shape [1, 0]) is refused as a bad request naming the input, not an
    IndexError (an internal error)."""
    with pytest.raises(TrtkvError, match="'max_tokens' must hold one value per request, got shape \\[1, 0\\]"):
        parse_request(get_of(text_input="x", max_tokens=np.zeros((1, 0), dtype=np.int32)))
    with pytest.raises(TrtkvError, match="'temperature' must hold one value"):
        parse_request(get_of(text_input="x", max_tokens=2, temperature=np.zeros((1, 0), dtype=np.float32)))


def test_end_id_reaches_the_sampling_params():
    """The end_id input is the request's end-of-sequence id."""
    assert parse_request(get_of(text_input="x", max_tokens=2, end_id=np.int32(17))).params.end_id == 17
    assert parse_request(get_of(text_input="x", max_tokens=2)).params.end_id is None


def test_temperature_zero_is_greedy_not_refused():
    """0 is greedy decoding (the interface's doc), only a negative one is refused."""
    p = parse_request(get_of(text_input="x", max_tokens=2, temperature=np.float32(0.0))).params
    assert p.greedy and p.temperature == 0.0
    with pytest.raises(TrtkvError, match="temperature must be >= 0"):
        parse_request(get_of(text_input="x", max_tokens=2, temperature=np.float32(-0.5)))


def test_empty_strings_in_the_word_lists_mean_none():
    """TensorRT-LLM clients pad stop_words / bad_words with empty strings, which
    mean "no word" (inputs.py); an empty stop word would match at once."""
    words = np.array([[b"", b"END", b""]], dtype=object)
    r = parse_request(get_of(text_input="x", max_tokens=3, stop_words=words, bad_words=np.array([[b""]], dtype=object)))
    assert r.params.stop_words == ["END"] and r.params.bad_words == []


def test_top_p_below_one_alone_makes_the_request_sample():
    """Interface.py: "a request samples when it gives temperature > 0, top_k > 1 or
    0 < top_p < 1"; with top_p 0.5 alone it samples at temperature 1."""
    r = parse_request(get_of(text_input="x", max_tokens=3, top_p=np.float32(0.5)))
    assert not r.params.greedy and r.params.temperature == 1.0 and r.params.top_p == 0.5
    r = parse_request(get_of(text_input="x", max_tokens=3, top_p=np.float32(1.0)))
    assert r.params.greedy
