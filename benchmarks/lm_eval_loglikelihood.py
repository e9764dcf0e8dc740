"""lm-evaluation-harness against a splitserve worker: a loglikelihood task from a local JSONL file, each item's
log-likelihood compared with transformers' on the same float32 weights.

    python3 -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install "lm-eval[api]==0.4.*" transformers
    .venv/bin/python benchmarks/lm_eval_loglikelihood.py --lm-eval /tmp/lmeval/bin/lm_eval

The harness runs as ``local-completions`` (tokenized requests, ``echo`` with ``logprobs``: the prompt's
logprobs, the way it scores any OpenAI-compatible server) on a task defined here: 40 items of a context and a
continuation, half a right continuation and half a wrong one, from ``datasets``' JSON loader (no download).
The worker runs twice: ``--quantization none --dtype float32`` (the same weights transformers computes with,
where the figures must agree within 1e-3) and its defaults (the GGUF's quantized blocks, where the difference
is the quantization's). transformers computes each item as lm-eval tokenizes it (the context's trailing
spaces moved to the continuation, the continuation's tokens those of the whole after the context's).
Results go to ``benchmarks/results/lm_eval_loglikelihood.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, SPLITSERVE, free_port, start_server, stop_server, write_result
from serving_vs_peers import load_hf_model, lscpu

FACTS = [
    ("The capital of France is", " Paris", " Berlin"),
    ("Water freezes at zero degrees", " Celsius", " Kelvin"),
    ("The largest planet in the solar system is", " Jupiter", " Mars"),
    ("The opposite of hot is", " cold", " blue"),
    ("A week has seven", " days", " apples"),
    ("The sun rises in the", " east", " cheese"),
    ("Two plus two equals", " four", " nine"),
    ("Birds can", " fly", " dissolve"),
    ("The chemical symbol for gold is", " Au", " Zz"),
    ("Shakespeare wrote", " Hamlet", " the Internet"),
    ("The first month of the year is", " January", " October"),
    ("Fish live in", " water", " clouds"),
    ("The color of the sky on a clear day is", " blue", " plaid"),
    ("A triangle has three", " sides", " wheels"),
    ("Ice is frozen", " water", " sand"),
    ("The Earth orbits the", " Sun", " Moon"),
    ("People read books in a", " library", " volcano"),
    ("Cats are often kept as", " pets", " furniture"),
    ("The Pacific is an", " ocean", " island"),
    ("A dozen means", " twelve", " seven"),
]
TASK = """task: splitserve_loglikelihood
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def items() -> list[dict[str, str]]:
    return [{"context": c, "continuation": x} for c, right, wrong in FACTS for x in (right, wrong)]


def run_lm_eval(lm_eval: str, url: str, tokenizer_dir: Path, task_dir: Path, out: Path) -> list[dict[str, Any]]:
    model_args = (f"model=smollm2,base_url={url}/v1/completions,tokenizer={tokenizer_dir},tokenized_requests=True,"
                  "num_concurrent=1,max_retries=1")  # fmt: skip
    cmd = [lm_eval, "run", "--model", "local-completions", "--model_args", model_args, "--tasks",
           "splitserve_loglikelihood", "--include_path", str(task_dir), "--output_path", str(out),
           "--log_samples"]  # fmt: skip
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if result.returncode != 0 and "invalid choice" in result.stderr:
        cmd.remove("run")  # lm-eval before 0.4.10 has no subcommands
        result = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"lm_eval failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    samples = sorted(out.rglob("samples_splitserve_loglikelihood*.jsonl"))
    rows = [json.loads(line) for line in samples[-1].read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda row: row["doc_id"])


def transformers_loglikelihoods(pairs: list[tuple[str, str]]) -> list[float]:
    """Each (context, continuation)'s log-likelihood in float32, tokenized as lm-eval's ``_encode_pair`` does."""
    import torch

    model, tokenizer = load_hf_model("float32")
    values = []
    for context, continuation in pairs:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = tokenizer.encode(context + continuation)
        start = len(tokenizer.encode(context))
        with torch.inference_mode():
            logits = model(torch.tensor([whole])).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        values.append(float(sum(logprobs[i - 1, whole[i]] for i in range(start, len(whole)))))
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lm-eval", required=True, help="the lm_eval executable of an environment with lm-eval")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/lm_eval_loglikelihood.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = root / "items.jsonl"
        data.write_text("".join(json.dumps(item) + "\n" for item in items()))
        task_dir = root / "tasks"
        task_dir.mkdir()
        (task_dir / "splitserve_loglikelihood.yaml").write_text(TASK.format(data=data))
        _, tokenizer = load_hf_model("float32")
        tokenizer.hf.save_pretrained(root / "tokenizer")
        pairs = [(item["context"], item["continuation"]) for item in items()]
        reference = transformers_loglikelihoods(pairs)
        results: dict[str, Any] = {"lscpu": lscpu(), "items": len(pairs)}
        for label, flags in (("float32", ["--quantization", "none", "--dtype", "float32"]), ("default", [])):
            port = free_port()
            cmd = [*SPLITSERVE, "worker", "--model", "smollm2", "--port", str(port), *flags]
            proc = start_server(cmd, port, root / f"worker-{label}.log")
            try:
                rows = run_lm_eval(args.lm_eval, f"http://127.0.0.1:{port}", root / "tokenizer", task_dir,
                                   root / f"out-{label}")  # fmt: skip
            finally:
                stop_server(proc)
            got = [float(row["resps"][0][0][0]) for row in rows]
            diffs = [abs(a - b) for a, b in zip(got, reference, strict=True)]
            results[label] = {
                "max_abs_diff": max(diffs), "mean_abs_diff": sum(diffs) / len(diffs),
                "per_item": [{"context": c, "continuation": x, "lm_eval": g, "transformers": r}
                             for (c, x), g, r in zip(pairs, got, reference, strict=True)],
                "right_beats_wrong": sum(got[2 * i] > got[2 * i + 1] for i in range(len(FACTS))),
            }  # fmt: skip
            print(label, "max |diff|", max(diffs))
        write_result(args.out, "lm_eval_loglikelihood", args, results)


if __name__ == "__main__":
    main()
