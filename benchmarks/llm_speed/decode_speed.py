"""Decode speed of our w4 KV-cache decoder against onnxruntime-genai's model builder (issue 32, acceptance 2).

``python -m benchmarks.run llm_speed [--rounds 20] [--profile]`` builds the issue's model in ``--work-dir``: a
random-initialised Llama-style LM (hidden 512, 4 layers, 8 heads / 4 KV heads, vocab 8192, 20 M parameters, a
byte-level BPE tokenizer trained on ``pydoc_data.topics``) saved with ``save_pretrained``. It then writes

* the builder's int4 file (``python -m onnxruntime_genai.models.builder -p int4 -e cpu``: round-to-nearest, block
  32, accuracy level 4), run in a child process (``--genai-package`` names the folder that holds the
  ``onnxruntime_genai`` package when it is not installed in this interpreter);
* ours: ``presets.w4(compute=...)`` through ``DecoderWithCache -> prepare -> calibrate`` (8 stdlib-docstring
  prompts, prefill + 4 decode steps) ``-> convert -> export_onnx(task="text-generation")``, for each compute mode.

Every file runs in one onnxruntime ``InferenceSession`` (1 intra-op thread, CPU provider) of this process, through
the same greedy loop: prefill of a 64-token prompt, then 63 one-token decode steps on the returned cache. Rounds are
interleaved (the variant order alternates each round); a variant's ratio in a round is its prefill time / decode
tok/s over the builder's in that round, and the table shows the median ratio with its range over the rounds.
``--profile`` adds onnxruntime's profile of one generation per file: kernel time per decode step by op type.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from benchmarks.common.results_file import write_page
from benchmarks.common.study import BENCHMARKS, add_settings_options, quiet_libraries

__all__ = ["configure", "run", "make_model", "Generator"]

RESULTS = BENCHMARKS / "llm_speed" / "RESULTS.md"
PROMPT, TOKENS = 64, 64
#: The issue's model: Llama-style, 20.2 M parameters.
LLAMA_20M = {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
             "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 512}
#: A few seconds' model for a smoke run (``--tiny``).
LLAMA_TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


def configure(parser: argparse.ArgumentParser) -> None:
    """The study's options."""
    add_settings_options(parser, RESULTS, latency=False)
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds (default 20)")
    parser.add_argument("--computes", nargs="+", default=["int8", "float"], choices=["int8", "float"],
                        help="our w4 files to write, by MatMulNBits compute mode (default: int8 float)")
    parser.add_argument("--genai-package", type=Path, default=None,
                        help="folder holding the onnxruntime_genai package, when this interpreter lacks it")
    parser.add_argument("--profile", action="store_true", help="add onnxruntime's per-op decode-step profile")
    parser.add_argument("--int8-kv-cache", action="store_true",
                        help="also write each of our files with an int8 KV cache (presets.int8_kv_cache()) and "
                             "report its speed against the same file with the float cache")


def make_model(folder: Path, sizes: dict[str, int]) -> Path:
    """A random-initialised Llama (seed 0) and a BPE tokenizer (vocab ``sizes["vocab_size"]``) in ``folder``."""
    import pydoc_data.topics

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if (folder / "model.safetensors").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=sizes["vocab_size"], special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(list(pydoc_data.topics.topics.values()), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(**sizes, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    return folder


def _builder_int4(model: Path, out: Path, genai_package: Path | None) -> Path:
    """The builder's ``-p int4 -e cpu`` file, written by a child process."""
    path = out / "model.onnx"
    if path.exists():
        return path
    code = ("import runpy, sys\n"
            "from benchmarks.common.torchvision_ops import declare_torchvision_ops\n"
            "declare_torchvision_ops()\n"
            f"sys.argv = ['builder', '-i', {str(model)!r}, '-o', {str(out)!r}, '-p', 'int4', '-e', 'cpu', "
            f"'-c', {str(out / 'cache')!r}]\n"
            "runpy.run_module('onnxruntime_genai.models.builder', run_name='__main__')\n")
    paths = [str(BENCHMARKS.parent)]
    if genai_package is not None:  # only the package, not the rest of its environment
        link = out.parent / "genai_package"
        link.mkdir(parents=True, exist_ok=True)
        if not (link / "onnxruntime_genai").exists():
            (link / "onnxruntime_genai").symlink_to(genai_package.resolve() / "onnxruntime_genai")
        paths.insert(0, str(link))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    if done.returncode or not path.exists():
        raise RuntimeError(f"onnxruntime-genai's builder failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return path


def _ours(model: Path, out: Path, compute: str, int8_cache: bool = False) -> tuple[Path, float]:
    """Our ``presets.w4(compute=compute)`` KV-cache file (``int8_cache``: the cache as int8 codes) and its seconds."""
    import pydoc_data.topics

    import coreai_opt as co
    from coreai_opt.graph.kv_cache_decoder import DecoderWithCache

    path = out / f"w4_{compute}{'_kv8' if int8_cache else ''}.onnx"
    start = time.perf_counter()
    if not path.exists():
        hf = co.from_pretrained(model, seq_len=PROMPT)
        decoder = DecoderWithCache(hf.model).eval()
        prompts = hf.prompt_ids([text[:400] for text in list(pydoc_data.topics.topics.values())[:8]])
        example = decoder.example_inputs()
        config = co.QuantizerConfig.presets.w4(compute=compute)
        config.kv_cache = co.QuantizerConfig.presets.int8_kv_cache() if int8_cache else None
        prepared = co.prepare(decoder, config, example, capture="export",
                              dynamic_shapes=decoder.capture_dynamic_shapes())
        co.calibrate(prepared, decoder.calibration_batches(prompts, 4))
        co.export_onnx(co.convert(prepared), example, path, task="text-generation")
    return path, time.perf_counter() - start


def session(path: Path, profile: bool = False) -> ort.InferenceSession:
    """One intra-op thread, CPU provider, all graph optimizations (onnxruntime's defaults otherwise)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.enable_profiling = profile
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class Generator:
    """Greedy generation through a decoder file with onnxruntime-genai's input / output names."""

    def __init__(self, sess: ort.InferenceSession, kv_heads: int, head_dim: int) -> None:
        self.session = sess
        self.outputs = [o.name for o in sess.get_outputs()]
        self.cache = [(i.name, i.name.replace("past_key_values", "present"))
                      for i in sess.get_inputs() if i.name.startswith("past_key_values")]
        self.positions = any(i.name == "position_ids" for i in sess.get_inputs())
        codes = any(i.type == "tensor(int8)" for i in sess.get_inputs())  # an int8 KV cache
        self.empty = np.zeros((1, kv_heads, 0, head_dim), np.int8 if codes else np.float32)

    def step(self, ids: np.ndarray, past: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Logits and the next past for ``ids`` after ``past``."""
        start = past[self.cache[0][0]].shape[2]
        feed = {"input_ids": ids, "attention_mask": np.ones((1, start + ids.shape[1]), np.int64), **past}
        if self.positions:
            feed["position_ids"] = np.arange(start, start + ids.shape[1], dtype=np.int64)[None]
        out = dict(zip(self.outputs, self.session.run(None, feed), strict=True))
        return out["logits"], {p: out[q] for p, q in self.cache}

    def generate(self, prompt: np.ndarray, tokens: int) -> tuple[float, float, list[int]]:
        """Prefill seconds, decode tokens / s over the ``tokens - 1`` cached steps, and the greedy tokens."""
        past = {name: self.empty for name, _ in self.cache}
        start = time.perf_counter()
        logits, past = self.step(prompt, past)
        prefilled = time.perf_counter()
        out = [int(logits[0, -1].argmax())]
        for _ in range(tokens - 1):
            logits, past = self.step(np.array([[out[-1]]], np.int64), past)
            out.append(int(logits[0, -1].argmax()))
        return prefilled - start, (tokens - 1) / (time.perf_counter() - prefilled), out


@dataclass
class _Row:
    name: str
    path: Path
    generator: Generator
    prefill: list[float] = field(default_factory=list)
    decode: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


def _graph(path: Path) -> str:
    model = onnx.load(str(path), load_external_data=False)
    counts = collections.Counter(n.op_type for n in model.graph.node)
    top = ", ".join(f"{op} {n}" for op, n in counts.most_common(6))
    levels = sorted({a.i for n in model.graph.node if n.op_type == "MatMulNBits" for a in n.attribute
                     if a.name == "accuracy_level"})
    return f"{len(model.graph.node)} nodes ({top}); MatMulNBits accuracy level {levels}"


def _profile(path: Path, generator_args: tuple[int, int], prompt: np.ndarray, tokens: int) -> list[str]:
    """Kernel microseconds per decode step by op type (onnxruntime's profiler, one generation)."""
    generator = Generator(session(path, profile=True), *generator_args)
    generator.generate(prompt, tokens)
    trace = Path(generator.session.end_profiling())
    events = json.loads(trace.read_text())
    trace.unlink()
    runs = [e for e in events if e.get("name") == "model_run"]
    after_prefill = runs[0]["ts"] + runs[0]["dur"]
    steps = len(runs) - 1
    by_op: collections.Counter[str] = collections.Counter()
    nodes: collections.Counter[str] = collections.Counter()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time") and event["ts"] > after_prefill:
            by_op[event["args"]["op_name"]] += event["dur"]
            nodes[event["args"]["op_name"]] += 1
    step = sum(r["dur"] for r in runs[1:]) / steps
    kernels = sum(by_op.values()) / steps
    lines = [f"decode step {step:.0f} µs (kernels {kernels:.0f} µs): " + ", ".join(
        f"{op} {t / steps:.0f} µs ×{nodes[op] // steps}" for op, t in by_op.most_common(8))]
    return lines


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}–{max(values):.3f}]"


def run(args: argparse.Namespace) -> int:
    """Build the model and the files, time them interleaved, write the table (module docstring)."""
    quiet_libraries()
    from benchmarks.common.torchvision_ops import declare_torchvision_ops

    declare_torchvision_ops()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="llm_speed_"))
    sizes = LLAMA_TINY if args.tiny else LLAMA_20M
    rounds = 2 if args.tiny else args.rounds
    model = make_model(work / ("llama_tiny" if args.tiny else "llama_20m"), sizes)
    heads = (sizes["num_key_value_heads"], sizes["hidden_size"] // sizes["num_attention_heads"])
    paths = {"builder int4": _builder_int4(model, work / "builder_int4", args.genai_package)}
    built: dict[str, float] = {}
    for compute in args.computes:
        paths[f"ours w4 compute={compute}"], built[compute] = _ours(model, work, compute)
        print(f"ours w4 compute={compute}: {built[compute]:.0f} s", flush=True)
        if args.int8_kv_cache:
            paths[f"ours w4 compute={compute}, int8 KV cache"], _ = _ours(model, work, compute, int8_cache=True)
    rows = [_Row(name, path, Generator(session(path), *heads)) for name, path in paths.items()]
    prompt = (np.arange(PROMPT, dtype=np.int64) * 37 % (sizes["vocab_size"] - 3) + 3)[None]
    for row in rows:  # warm-up, and the tokens each file generates
        row.tokens = row.generator.generate(prompt, TOKENS)[2]
    for r in range(rounds):
        for row in rows if r % 2 == 0 else rows[::-1]:
            prefill, decode, _ = row.generator.generate(prompt, TOKENS)
            row.prefill.append(prefill)
            row.decode.append(decode)
        print(f"round {r + 1}/{rounds}", flush=True)
    base = rows[0]
    lines = [
        "# llm_speed: our w4 KV-cache decoder vs onnxruntime-genai's builder int4", "",
        f"Model: {'tiny smoke model' if args.tiny else 'random-init Llama-style, 20.2 M parameters'} "
        f"({', '.join(f'{k} {v}' for k, v in sizes.items())}). Batch 1, prompt {PROMPT} tokens, {TOKENS} greedy "
        f"tokens (prefill + {TOKENS - 1} cached decode steps), onnxruntime {ort.__version__} CPU, 1 intra-op "
        f"thread, {rounds} interleaved rounds in one process. Ratio = ours / builder in the same round: median "
        "[min–max]. Prefill ≤ 1.05× and decode ≥ 0.95× is the issue's bar. Absolute times are from a shared "
        "2-core machine: read the ratios.", "",
        "| file | prefill ms | decode tok/s | prefill / builder | decode tok/s / builder | graph |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        prefill = [a / b for a, b in zip(row.prefill, base.prefill, strict=True)]
        decode = [a / b for a, b in zip(row.decode, base.decode, strict=True)]
        lines.append(f"| {row.name} | {statistics.median(row.prefill) * 1e3:.2f} | {statistics.median(row.decode):.0f}"
                     f" | {_spread(prefill)} | {_spread(decode)} | {_graph(row.path)} |")
    by_name = {row.name: row for row in rows}
    for row in rows:  # an int8 KV cache against the same file with the float cache, round by round
        twin = by_name.get(row.name.removesuffix(", int8 KV cache"))
        if twin is not None and twin is not row:
            prefill = [a / b for a, b in zip(row.prefill, twin.prefill, strict=True)]
            decode = [a / b for a, b in zip(row.decode, twin.decode, strict=True)]
            lines.append(f"\n{row.name} / {twin.name}: prefill {_spread(prefill)}, decode tok/s {_spread(decode)}")
    lines += ["", "Greedy tokens (first 16) per file: " + "; ".join(
        f"{row.name}: {row.tokens[:16]}" for row in rows), ""]
    if args.profile:
        lines += ["## Where a decode step's time goes (onnxruntime profiler, kernel time by op type)", ""]
        lines += [f"- {row.name}: {_profile(row.path, heads, prompt, TOKENS)[0]}" for row in rows]
        lines.append("")
    text = "\n".join(lines)
    print(text)
    write_page(args.output, text)
    return 0
