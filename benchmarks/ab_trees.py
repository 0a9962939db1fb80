"""pdserve against itself: two source trees (e.g. a commit before a change and after it) side by side in
one run, offline and served, rounds alternated so the machine's drift hits both.

Each tree runs from its own directory (PYTHONPATH first, so its packages win over the installed
ones), in fresh processes: offline, `benchmarks/vs_vllm.py`'s pdserve worker (N prompts of P random
token ids, O greedy output tokens, EOS ignored; output tokens/s of the timed generate after a warm-up
one); served, `pdserve up` in the layout (1 prefill + 1 decode node by default) driven by
`pdserve bench` at rate inf. Both trees need their compiled kernels built (a tree from before
kernels were built at install builds them on first use). Reports each cell's median and the
ratios B/A, and ends with `RESULT {json}`.

    .venv/bin/python benchmarks/ab_trees.py --tree-a /tmp/before --tree-b . [--preset small] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.results_io import commit_of, write_result  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree-a", required=True, help="the baseline source tree")
    parser.add_argument("--tree-b", default=str(REPO), help="the tree under test (default: this one)")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--modes", default="offline,served")
    parser.add_argument("--layout", default="1:1", help="served PREFILL:DECODE nodes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out-dir", default=str(REPO / "benchmarks" / "out"))
    return parser.parse_args(argv)


def tree_env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree)}


def offline(tree: Path, args, model_dir: Path, prompts_file: Path) -> float:
    argv = [sys.executable, str(tree / "benchmarks" / "vs_vllm.py"), "--worker", "pdserve-offline", "--model",
            str(model_dir), "--prompts-file", str(prompts_file), "--output-len", str(args.output_len),
            "--dtype", args.dtype]
    done = subprocess.run(argv, capture_output=True, text=True, env=tree_env(tree), cwd=tree, timeout=3600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("WORKER ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"offline worker of {tree} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    elapsed = json.loads(lines[-1][len("WORKER "):])["elapsed_s"]
    return args.num_prompts * args.output_len / elapsed


_SERVED = """
import json, sys
from pathlib import Path
from benchmarks.vs_vllm import parse_args, served_pdserve
args = parse_args(sys.argv[1:])
print("SERVED " + json.dumps(served_pdserve(args, Path(args.model), int(args.port), args.served_layouts)))
"""


def served(tree: Path, args, model_dir: Path, vocab: int) -> dict:
    """One served run of tree's `pdserve up` through vs_vllm's own served helper (the vocabulary
    passed in --port's place)."""
    argv = [sys.executable, "-c", _SERVED, "--model", str(model_dir), "--port", str(vocab),
            "--served-layouts", args.layout, "--dtype", args.dtype, "--num-prompts", str(args.num_prompts),
            "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len), "--out-dir", args.out_dir]
    done = subprocess.run(argv, capture_output=True, text=True, env=tree_env(tree), cwd=tree, timeout=3600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("SERVED ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"served run of {tree} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len("SERVED "):])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from benchmarks.vs_vllm import make_prompts
    from pdserve.default_model import ensure_model

    trees = {"a": Path(args.tree_a).resolve(), "b": Path(args.tree_b).resolve()}
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_model(REPO / ".cache" / "models" / f"{args.preset}-seed0", args.preset)
    prompts_file, vocab = make_prompts(model_dir, args, out_dir)
    cells: dict[str, dict[str, list]] = {}
    for idx in range(args.rounds):
        order = ("a", "b") if idx % 2 == 0 else ("b", "a")
        for mode in args.modes.split(","):
            for side in order:
                print(f"== round {idx + 1}/{args.rounds} {mode} {side} ({trees[side]})", flush=True)
                if mode == "offline":
                    value = {"tok_s": offline(trees[side], args, model_dir, prompts_file)}
                else:
                    value = served(trees[side], args, model_dir, vocab)
                print(f"   {json.dumps(value)}", flush=True)
                cells.setdefault(mode, {}).setdefault(side, []).append(value)
    rows = []
    for mode, sides in cells.items():
        medians = {side: statistics.median(v["tok_s"] for v in values) for side, values in sides.items()}
        rounds = [b["tok_s"] / a["tok_s"] for a, b in zip(sides["a"], sides["b"])]
        rows.append({"mode": mode if mode == "offline" else f"served {args.layout}", "a_tok_s": round(medians["a"], 1),
                     "b_tok_s": round(medians["b"], 1), "b_over_a": round(medians["b"] / medians["a"], 4),
                     "round_ratios": [round(r, 4) for r in rounds]})
        print(f"{rows[-1]['mode']}: A {medians['a']:.1f} tok/s, B {medians['b']:.1f} tok/s, "
              f"B/A {medians['b'] / medians['a']:.3f} (rounds {', '.join(f'{r:.3f}' for r in rounds)})")
    commits = {side: commit_of(tree) for side, tree in trees.items()}
    write_result("ab_trees", {"preset": args.preset, "dtype": args.dtype, "tree_a": str(trees["a"]),
                              "tree_b": str(trees["b"]), "rows": rows,
                              **{f"tree_{side}_commit": commit + ("+" if dirty else "") if commit else None
                                 for side, (commit, dirty) in commits.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
