"""A tiny Llama (GQA: 4 heads, 2 KV heads) as one KV-cache decoder graph: prefill and decode in onnxruntime give the
same greedy tokens as the converted eager model, and a cached decode step is cheaper than a full forward."""

from __future__ import annotations

import statistics
import time
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

import coreai_opt as co
from coreai_opt.graph.kv_cache_decoder import DecoderWithCache, causal_mask
from tests.cli.conftest import save_tiny_llama

PROMPTS = ["the cat sat on the mat", "a very good movie", "the dog is bad w1 w2"]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> co.huggingface.PretrainedModel:
    directory = save_tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama")
    return co.from_pretrained(directory, seq_len=16)


def _prompts(hf) -> list[torch.Tensor]:
    return [hf.preprocessor(line, return_tensors="pt")["input_ids"][0] for line in PROMPTS]


def _greedy(step, prompt: np.ndarray, empty_past: list, count: int) -> list[int]:
    """Greedy decoding through ``step(ids, mask, positions, past) -> (logits, present)`` with the KV cache."""
    ids, past, tokens = prompt.reshape(1, -1), empty_past, []
    for _ in range(count):
        start = past[0].shape[2]
        mask = np.ones((1, start + ids.shape[1]), np.int64)
        positions = np.arange(start, start + ids.shape[1], dtype=np.int64).reshape(1, -1)
        logits, past = step(ids, mask, positions, past)
        tokens.append(int(np.argmax(logits[0, -1])))
        ids = np.array([[tokens[-1]]], np.int64)
    return tokens


def _eager_step(model):
    @torch.no_grad()
    def step(ids, mask, positions, past):
        out = model(*(torch.from_numpy(np.asarray(t)) for t in (ids, mask, positions, *past)))
        return out[0].numpy(), [t.numpy() for t in out[1:]]
    return step


def _ort_step(session: ort.InferenceSession):
    names = [i.name for i in session.get_inputs()]

    def step(ids, mask, positions, past):
        out = session.run(None, dict(zip(names, (ids, mask, positions, *past), strict=True)))
        return out[0], out[1:]
    return step


def test_causal_mask_sees_the_past_and_earlier_new_tokens_but_no_padding():
    mask = causal_mask(torch.tensor([[0, 1, 1, 1, 1]]), 2)  # 3 cached positions (the first one padding), 2 new
    assert mask.shape == (1, 1, 2, 5)
    assert mask[0, 0].int().tolist() == [[0, 1, 1, 1, 0], [0, 1, 1, 1, 1]]


@pytest.mark.parametrize(("sequence", "past"), [(5, 0), (1, 7), (3, 4)])
def test_grouped_query_attention_folded_into_the_query_axis_equals_sdpa_repeating_the_keys(sequence, past):
    from coreai_opt.graph.kv_cache_decoder import _attention

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, sequence, 16, generator=generator)
    k, v = (torch.randn(2, 4, sequence + past, 16, generator=generator) for _ in range(2))
    attention_mask = torch.ones(2, sequence + past, dtype=torch.int64)
    attention_mask[1, 0] = 0  # a padded position in the second row
    mask = causal_mask(attention_mask, sequence)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25,
                                                                enable_gqa=True).transpose(1, 2)
    for given in (mask, mask.expand(2, 8, sequence, sequence + past)):  # one mask for all heads, or per head
        out, _ = _attention(torch.nn.Module(), q, k, v, given, scaling=0.25)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)  # same dot products, other kernel blocking


def test_the_decoder_file_never_repeats_the_cache_per_query_group(exported):
    """No Expand / Tile reads a present key or value (directly or through an Unsqueeze / Reshape)."""
    import onnx

    _, _, _, path = exported
    graph = onnx.load(str(path)).graph
    producer = {out: node for node in graph.node for out in node.output}

    def from_cache(name: str, depth: int = 3) -> bool:
        node = producer.get(name)
        if name.startswith(("present.", "past_key_values.")):
            return True
        return depth > 0 and node is not None and node.op_type in ("Unsqueeze", "Reshape", "Transpose") and \
            from_cache(node.input[0], depth - 1)

    repeats = [n.name for n in graph.node if n.op_type in ("Expand", "Tile") and from_cache(n.input[0])]
    assert repeats == []


def test_wrapping_and_running_leave_the_users_model_as_it_was(llama):
    """The wrapper's attention function serves its own calls only: the model's config and outputs are unchanged."""
    ids = _prompts(llama)[0].reshape(1, -1)
    implementation = llama.model.config._attn_implementation
    with torch.no_grad():
        before = llama.model(ids).logits
        wrapper = DecoderWithCache(llama.model)
        assert llama.model.config._attn_implementation == implementation
        wrapper(ids, torch.ones_like(ids), torch.arange(ids.shape[1]).reshape(1, -1),
                *wrapper.empty_cache(1))
        assert llama.model.config._attn_implementation == implementation
        after = llama.model(ids).logits
        prefix = llama.model(ids[:, :3]).logits
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    torch.testing.assert_close(after[:, :3], prefix, rtol=1e-5, atol=1e-5)  # no token sees a later one


def test_cached_prefill_then_decode_equals_the_float_full_forward(llama):
    decoder = DecoderWithCache(llama.model)
    assert decoder.num_layers == 2 and decoder.kv_heads == 2 and decoder.head_dim == 16
    ids = _prompts(llama)[0].reshape(1, -1)
    with torch.no_grad():
        full = llama.model(ids).logits
        n = ids.shape[1] - 2
        logits, *present = decoder(ids[:, :n], torch.ones(1, n, dtype=torch.int64), torch.arange(n)[None],
                                   *decoder.empty_cache(1))
        rest, *after = decoder(ids[:, n:], torch.ones(1, n + 2, dtype=torch.int64), torch.arange(n, n + 2)[None],
                               *present)
    assert [tuple(t.shape) for t in after] == [(1, 2, n + 2, 16)] * 4
    torch.testing.assert_close(torch.cat([logits, rest], 1), full, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module", params=["w8a8", pytest.param("w4", marks=pytest.mark.slow)])
def exported(request, llama, tmp_path_factory) -> tuple[str, torch.nn.Module, DecoderWithCache, Path]:
    decoder = DecoderWithCache(llama.model).eval()
    config = getattr(co.QuantizerConfig.presets, request.param)()
    example = decoder.example_inputs()
    prepared = co.prepare(decoder, config, example, capture="export", dynamic_shapes=decoder.capture_dynamic_shapes())
    co.calibrate(prepared, decoder.calibration_batches(_prompts(llama), decode_steps=4))
    converted = co.convert(prepared)
    path = co.export_onnx(converted, example, tmp_path_factory.mktemp("kv") / f"llama.{request.param}.onnx",
                          task="text-generation")
    return request.param, converted, decoder, path


def _session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def test_decoder_file_has_onnxruntime_genai_names_and_dynamic_batch_sequence_and_past(exported):
    _, _, _, path = exported
    session = _session(path)
    inputs = [(i.name, i.shape) for i in session.get_inputs()]
    tokens = ["batch_size", "sequence_length"]
    cache = ["batch_size", 2, "past_sequence_length", 16]
    assert inputs == [("input_ids", tokens), ("attention_mask", ["batch_size", "total_sequence_length"]),
                      ("position_ids", tokens),
                      *((f"past_key_values.{i}.{kv}", cache) for i in range(2) for kv in ("key", "value"))]
    outputs = [o.name for o in session.get_outputs()]
    assert outputs == ["logits", *(f"present.{i}.{kv}" for i in range(2) for kv in ("key", "value"))]
    assert session.get_outputs()[0].shape == [*tokens, 97]


def test_greedy_generation_with_the_kv_cache_is_token_identical_in_onnxruntime_and_eager(exported, llama):
    preset, converted, decoder, path = exported
    session = _session(path)
    empty = [t.numpy() for t in decoder.empty_cache(1)]
    for prompt in _prompts(llama):
        in_ort = _greedy(_ort_step(session), prompt.numpy(), empty, NEW_TOKENS)
        in_eager = _greedy(_eager_step(converted), prompt.numpy(), empty, NEW_TOKENS)
        assert in_ort == in_eager, f"{preset}: first difference at token {_first_difference(in_ort, in_eager)}"
        assert len(set(in_ort)) > 3  # a real continuation, not one repeated id


def _first_difference(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)


def test_a_cached_decode_step_is_faster_than_the_full_forward_it_replaces(exported, llama):
    """Interleaved rounds on one session: decode 1 token after a 38-token cache vs a forward over all 39 tokens."""
    _, _, decoder, path = exported
    session = _session(path)
    step = _ort_step(session)
    ids = np.arange(3, 42, dtype=np.int64).reshape(1, -1)  # 39 tokens
    total = ids.shape[1]
    _, past = step(ids[:, :-1], np.ones((1, total - 1), np.int64), np.arange(total - 1)[None],
                   [t.numpy() for t in decoder.empty_cache(1)])
    empty = [t.numpy() for t in decoder.empty_cache(1)]
    full_args = (ids, np.ones((1, total), np.int64), np.arange(total)[None], empty)
    cached_args = (ids[:, -1:], np.ones((1, total), np.int64), np.array([[total - 1]]), past)
    full_logits, _ = step(*full_args)
    cached_logits, _ = step(*cached_args)
    np.testing.assert_allclose(cached_logits[0, -1], full_logits[0, -1], atol=1e-4)  # the same prediction
    ratios = []
    for _ in range(15):
        times = []
        for args in (cached_args, full_args):
            start = time.perf_counter()
            for _ in range(20):
                step(*args)
            times.append(time.perf_counter() - start)
        ratios.append(times[0] / times[1])
    assert statistics.median(ratios) < 1.0, f"cached / full time ratios: {sorted(ratios)}"


def test_generation_report_names_the_first_differing_step_and_its_margin():
    from coreai_opt.onnx.verify.generation import GenerationReport

    report = GenerationReport(onnxruntime=[[1, 2, 3], [4, 5, 6]], eager=[[1, 2, 3], [4, 7, 6]],
                              first_difference=[None, 1], margins=[None, 0.0043])
    assert not report.ok and report.identical == 4 and report.total == 6
    assert str(report).splitlines() == [
        "greedy generation, onnxruntime vs eager (KV cache): 2 prompt(s), 4/6 tokens identical, ok=False",
        "  prompt 1: first difference at step 1 (eager top-2 margin 0.0043)"]


def test_genai_config_names_the_decoder_file_its_sizes_io_names_and_token_ids(llama, tmp_path):
    import json

    from coreai_opt.onnx.export.genai_config import write_genai_files

    written = write_genai_files(tmp_path / "model.onnx", llama.model.config, llama.preprocessor)
    assert sorted(p.name for p in written) == ["genai_config.json", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((tmp_path / "genai_config.json").read_text())
    model, decoder = config["model"], config["model"]["decoder"]
    assert (model["bos_token_id"], model["eos_token_id"], model["pad_token_id"]) == (1, 2, 2)
    assert (model["type"], model["vocab_size"], model["context_length"]) == ("llama", 97, 256)
    assert decoder["filename"] == "model.onnx"
    assert (decoder["head_size"], decoder["hidden_size"], decoder["num_attention_heads"],
            decoder["num_key_value_heads"], decoder["num_hidden_layers"]) == (16, 64, 4, 2, 2)
    assert decoder["inputs"] == {"input_ids": "input_ids", "attention_mask": "attention_mask",
                                 "position_ids": "position_ids", "past_key_names": "past_key_values.%d.key",
                                 "past_value_names": "past_key_values.%d.value"}
    assert decoder["outputs"] == {"logits": "logits", "present_key_names": "present.%d.key",
                                  "present_value_names": "present.%d.value"}
    assert config["search"]["past_present_share_buffer"] is False and config["search"]["top_k"] == 1


@pytest.mark.parametrize("per_token", [False, True])
def test_a_decoder_with_one_dynamic_scale_per_call_is_warned_and_one_per_token_is_not(llama, tmp_path, per_token):
    decoder = DecoderWithCache(llama.model).eval()
    example = decoder.example_inputs()
    config = co.QuantizerConfig.presets.w8a8_dynamic(per_token=per_token)
    prepared = co.prepare(decoder, config, example, capture="export", dynamic_shapes=decoder.capture_dynamic_shapes())
    converted = co.convert(prepared)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        co.export_onnx(converted, example, tmp_path / "decoder.onnx", task="text-generation")
    named = [str(w.message) for w in caught if "w8a8_dynamic(per_token=True)" in str(w.message)]
    assert len(named) == (0 if per_token else 1)
    if not per_token:
        assert "9 dynamic activation quantizer(s) of one scale per call (model.model.layers.0." in named[0]
