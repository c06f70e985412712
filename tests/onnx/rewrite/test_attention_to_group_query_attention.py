"""attention_to_group_query_attention: a tiny Llama's KV-cache decoder file with one GroupQueryAttention per layer
gives the logits and presents of the same file without the rule (float rounding) on prefill, on cached decode steps
and on a left-padded batch, and attention blocks the rule does not recognise stay as they are."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import coreai_opt as co
from coreai_opt.graph.kv_cache_decoder import DecoderWithCache
from coreai_opt.onnx import rewrite
from coreai_opt.onnx.rewrite.rules.attention_to_group_query_attention import AttentionToGroupQueryAttention
from tests.cli.conftest import save_tiny_llama
from tests.onnx.rewrite.rule_checks import apply_rule, assert_idempotent, copy, ops

RULE = AttentionToGroupQueryAttention()
KV_HEADS, LAYERS = 2, 2


def _export(directory: Path, out: Path, with_rule: bool, monkeypatch: pytest.MonkeyPatch) -> onnx.ModelProto:
    hf = co.from_pretrained(directory, seq_len=16)
    decoder = DecoderWithCache(hf.model).eval()
    example = decoder.example_inputs()
    prepared = co.prepare(decoder, co.QuantizerConfig.presets.w4(), example, capture="export",
                          dynamic_shapes=decoder.capture_dynamic_shapes())
    prompts = [hf.preprocessor(line, return_tensors="pt")["input_ids"][0] for line in ("the cat sat on the mat",)]
    co.calibrate(prepared, decoder.calibration_batches(prompts, decode_steps=2))
    converted = co.convert(prepared)
    paths = {}
    for name, rules in (("original", tuple(r for r in rewrite.POST_PASSES if r.name != RULE.name)),
                        ("rewritten", rewrite.POST_PASSES)):
        if name == "rewritten" and not with_rule:
            break
        with monkeypatch.context() as patch:
            patch.setattr(rewrite, "POST_PASSES", rules)
            paths[name] = co.export_onnx(converted, example, out / f"{name}.onnx", task="text-generation")
    return paths


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """The tiny Llama (head size 16, 4 heads over 2 key / value heads) exported without and with the rule."""
    root = tmp_path_factory.mktemp("gqa")
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _export(save_tiny_llama(root / "llama"), root, True, monkeypatch)


def _session(path: Path | onnx.ModelProto) -> ort.InferenceSession:
    data = str(path) if isinstance(path, Path) else path.SerializeToString()
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"])


def _feed(batch: int, sequence: int, past: int, padding: int = 0, seed: int = 0) -> dict[str, np.ndarray]:
    """Token ids after ``past`` cached positions; row 1 left-padded by ``padding`` positions (HF's position ids)."""
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, past + sequence), np.int64)
    mask[1:, :padding] = 0
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, past:]
    caches = {f"past_key_values.{i}.{part}": rng.standard_normal((batch, KV_HEADS, past, 16)).astype(np.float32)
              for i in range(LAYERS) for part in ("key", "value")}
    return {"input_ids": rng.integers(3, 20, (batch, sequence)), "attention_mask": mask, "position_ids": positions,
            **caches}


def _run(path: Path | onnx.ModelProto, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = _session(path)
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feed), strict=True))


def test_each_layer_becomes_per_row_rotary_and_one_group_query_attention(files):
    original, rewritten = (onnx.load(str(files[name])) for name in ("original", "rewritten"))
    kinds = ops(rewritten)
    assert kinds.count("GroupQueryAttention") == LAYERS and kinds.count("RotaryEmbedding") == 2 * LAYERS
    assert "Softmax" not in kinds and "Neg" not in kinds and "Transpose" not in kinds
    assert "LessOrEqual" not in kinds and "Range" not in kinds  # the kernel is causal: only the padding bias is left
    assert len(kinds) < len(ops(original)) // 2
    for node in (n for n in rewritten.graph.node if n.op_type == "GroupQueryAttention"):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert (attrs["num_heads"], attrs["kv_num_heads"], attrs["do_rotary"]) == (4, 2, 0)
        assert attrs["scale"] == pytest.approx(16 ** -0.5)
        assert list(node.input[7:10]) == ["", "", ""]  # no cos / sin / position_ids: rotary is done before
        for rotated in node.input[:2]:
            rotary = next(n for n in rewritten.graph.node if rotated in n.output)
            assert rotary.op_type == "RotaryEmbedding" and rotary.input[1] == "position_ids"
            assert {a.name: onnx.helper.get_attribute_value(a) for a in rotary.attribute} == {"interleaved": 0}
        assert list(node.output[1:]) == [f"present.{node.input[3].split('.')[1]}.key",
                                         f"present.{node.input[3].split('.')[1]}.value"]


@pytest.mark.parametrize(("batch", "sequence", "past", "padding"), [
    (1, 7, 0, 0), (1, 1, 9, 0), (1, 4, 5, 0), (2, 6, 0, 0), (2, 1, 8, 0), (2, 1, 8, 2)],
    ids=["prefill", "decode", "chunk_after_past", "batch2_prefill", "batch2_decode", "batch2_left_padded_decode"])
def test_rewritten_file_equals_the_original_on_prefill_and_decode_steps(files, batch, sequence, past, padding):
    feed = _feed(batch, sequence, past, padding)
    expected, got = _run(files["original"], feed), _run(files["rewritten"], feed)
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        assert got[name].shape == value.shape
        np.testing.assert_allclose(got[name], value, rtol=0, atol=2e-6, err_msg=name)


def test_left_padded_batch_prefill_then_decode_steps_equal_the_original_at_real_positions(files):
    """onnxruntime 1.32's ``GroupQueryAttention(do_rotary=1)`` rotates every row of a batch prompt by row 0's
    ``position_ids``; the rule rotates with ``RotaryEmbedding`` (per-row positions) instead. A batch of 2, row 1
    left-padded by 2 (Hugging Face positions ``cumsum(mask) - 1``): the prompt, then 3 cached decode steps, each
    file fed its own presents, give the original's logits and presents at every real position."""
    padding, prompt = 2, 6
    feed = _feed(2, prompt, 0, padding=padding)
    state = {name: dict(feed) for name in ("original", "rewritten")}
    for step in range(4):
        out = {name: _run(files[name], state[name]) for name in state}
        real = slice(padding, None) if step == 0 else slice(None)  # a prompt's padding queries see no key
        np.testing.assert_allclose(out["rewritten"]["logits"][:, real], out["original"]["logits"][:, real],
                                   rtol=0, atol=2e-6, err_msg=f"logits, step {step}")
        for name in (n for n in out["original"] if n.startswith("present")):
            for row in range(2):
                keys = slice(padding if row else 0, None)
                np.testing.assert_allclose(out["rewritten"][name][row, :, keys], out["original"][name][row, :, keys],
                                           rtol=0, atol=2e-6, err_msg=f"{name}, row {row}, step {step}")
        token = out["original"]["logits"][:, -1].argmax(-1)[:, None]
        mask = np.concatenate([state["original"]["attention_mask"], np.ones((2, 1), np.int64)], axis=1)
        for name in state:
            state[name] = {"input_ids": token, "attention_mask": mask,
                           "position_ids": mask.sum(axis=1, keepdims=True) - 1,
                           **{k.replace("present", "past_key_values"): v for k, v in out[name].items()
                              if k != "logits"}}


def test_greedy_decoding_with_the_cache_gives_the_same_tokens_as_the_original(files):
    def greedy(path: Path) -> list[int]:
        session, tokens = _session(path), []
        feed = _feed(1, 5, 0)
        for _ in range(12):
            out = dict(zip([o.name for o in session.get_outputs()], session.run(None, feed), strict=True))
            tokens.append(int(out["logits"][0, -1].argmax()))
            total = feed["attention_mask"].shape[1] + 1
            feed = {"input_ids": np.array([[tokens[-1]]]), "attention_mask": np.ones((1, total), np.int64),
                    "position_ids": np.array([[total - 1]]),
                    **{k.replace("present", "past_key_values"): v for k, v in out.items() if k != "logits"}}
        return tokens

    assert greedy(files["rewritten"]) == greedy(files["original"])


def test_rotary_caches_are_the_models_own_cos_and_sin(files, tmp_path):
    from transformers import LlamaForCausalLM

    model = onnx.load(str(files["rewritten"]))
    tables = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer if "gqa_" in t.name}
    cos = next(v for k, v in tables.items() if "cos" in k)
    sin = next(v for k, v in tables.items() if "sin" in k)
    assert cos.shape == sin.shape == (RULE.max_positions, 8)
    llama = LlamaForCausalLM.from_pretrained(save_tiny_llama(tmp_path / "llama"))
    positions = torch.arange(300)[None]
    expected_cos, expected_sin = llama.model.rotary_emb(torch.zeros(1, 300, 16), positions)
    np.testing.assert_allclose(cos[:300], expected_cos[0, :, :8].numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(sin[:300], expected_sin[0, :, :8].numpy(), rtol=0, atol=1e-5)


def test_a_position_beyond_the_rotary_cache_is_refused_by_onnxruntime(files):
    model = onnx.load(str(files["original"]))
    assert apply_rule(model, AttentionToGroupQueryAttention(max_positions=12)) == (LAYERS, [])
    _run(model, _feed(1, 2, 10))  # positions 10, 11: served
    with pytest.raises(Exception, match=r"position_ids value 12 at index 0 is out of range \[0, 12\)"):
        _run(model, _feed(1, 1, 12))


def test_a_negative_padding_position_is_refused_by_onnxruntime_not_computed_wrong(files):
    feed = _feed(2, 6, 0, padding=2)
    feed["position_ids"] = np.cumsum(feed["attention_mask"], axis=1) - 1  # -1 at row 1's padding, no masked_fill
    _run(files["original"], feed)
    with pytest.raises(Exception, match=r"position_ids value -1 at index 6 is out of range \[0, 4096\)"):
        _run(files["rewritten"], feed)


def test_a_batch_chunk_after_a_past_is_refused_by_onnxruntime_not_computed_wrong(files):
    with pytest.raises(Exception, match="batch_size must be 1 when sequence_length > 1 and past context is given"):
        _run(files["rewritten"], _feed(2, 3, 5))


def test_the_rule_is_idempotent_on_its_own_output(files):
    assert_idempotent(onnx.load(str(files["rewritten"])), RULE)


def _mutated(files: dict[str, Path], change) -> onnx.ModelProto:
    model = onnx.load(str(files["original"]))
    change(model.graph)
    return model


def _extra_mask_term(graph: onnx.GraphProto) -> None:
    """One more ``And`` on the causal & padding mask, as a sliding window writes it (here: the mask itself)."""
    both = next(n for n in graph.node if n.op_type == "And")
    inner = both.output[0] + "_inner"
    extra = onnx.helper.make_node("And", [inner, inner], [both.output[0]], name="window")
    both.output[0] = inner
    nodes = list(graph.node)
    nodes.insert(nodes.index(both) + 1, extra)
    del graph.node[:]
    graph.node.extend(nodes)


def _partial_rotary(graph: onnx.GraphProto) -> None:
    """The rotate-half ``Slice`` pairs read ``[0:4]`` and ``[4:8]``: a rotary over the first half of the head."""
    graph.initializer.extend([onnx.numpy_helper.from_array(np.array([v], np.int64), f"bound_{v}") for v in (4, 8)])
    constants = {t.name: onnx.numpy_helper.to_array(t).tolist() for t in graph.initializer}
    for node in (n for n in graph.node if n.op_type == "Slice"):
        bounds = constants[node.input[1]], constants[node.input[2]]
        if bounds == ([0], [8]):
            node.input[2] = "bound_4"
        elif bounds[0] == [8]:
            node.input[1], node.input[2] = "bound_4", "bound_8"


@pytest.mark.parametrize(("change", "reason"), [
    (_extra_mask_term, "the mask is not causal & attention_mask"),
    (_partial_rotary, "not rotate-half rotary over the whole head"),
])
def test_an_attention_block_it_does_not_recognise_stays_as_it_is(files, change, reason):
    model = _mutated(files, change)
    onnx.checker.check_model(model)
    before = copy(model).SerializeToString()
    count, reasons = apply_rule(model, RULE)
    assert count == 0
    assert len(reasons) == LAYERS and all(reason in r for r in reasons)
    assert model.SerializeToString() == before


def test_multi_head_attention_without_groups_is_rewritten_and_equals_the_original(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = save_tiny_llama(tmp_path / "llama")
    torch.manual_seed(0)
    config = LlamaConfig.from_pretrained(directory)
    config.num_key_value_heads = 4
    LlamaForCausalLM(config).eval().save_pretrained(directory)
    with pytest.MonkeyPatch.context() as monkeypatch:
        paths = _export(directory, tmp_path, True, monkeypatch)
    assert ops(onnx.load(str(paths["rewritten"]))).count("GroupQueryAttention") == LAYERS
    for feed in (_feed(1, 5, 0), _feed(2, 1, 6, padding=1)):
        feed = {k: np.repeat(v, 2, axis=1) if k.startswith("past") else v for k, v in feed.items()}  # 4 kv heads
        expected, got = _run(paths["original"], feed), _run(paths["rewritten"], feed)
        for name, value in expected.items():
            np.testing.assert_allclose(got[name], value, rtol=0, atol=2e-6, err_msg=name)


def test_a_head_size_of_8_is_left_alone_with_a_near_miss(tmp_path):
    with pytest.MonkeyPatch.context() as monkeypatch:
        paths = _export(save_tiny_llama(tmp_path / "llama", hidden=32), tmp_path, False, monkeypatch)
    model = onnx.load(str(paths["original"]))
    count, reasons = apply_rule(model, RULE)
    assert count == 0
    assert reasons == ["head size 8 is not a multiple of 16 (onnxruntime's rotary kernel)"] * LAYERS
