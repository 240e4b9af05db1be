"""The README's "Real size" tables from one `python3 -m graft.bench --real ... --json` run.

    python3 bench/real_size_table.py bench/results/real-size/run-amd-all.json

Prints the float32 table (step, peak anonymous memory, first call, share of the GEMM ceiling: the
step's matrix-product FLOPs at the run's measured GEMM rate over the step time, so eager's share is
also the lowest step, as a fraction of eager's, that any system doing those products can reach) and
the bf16 table (step, memory, first call, first losses) for the models the run has, the lowest
step and memory of each row in bold, then each system's rounds. Only what the JSON holds.
"""
import json
import sys

NAMES = {"gpt2": "GPT-2 124M, 4 x 512", "bert": "BERT-base, 8 x 256", "resnet50": "ResNet-50, 16 x 224²",
         "vit": "ViT-B/16, 8 x 224²", "llama1b": "Llama-style 1B, 1 x 512"}
FP32 = ["eager", "compile", "compile-max", "graft-hook", "graft-step"]
BF16 = ["eager-bf16", "compile-bf16", "graft-bf16"]


def main(path):
    d = json.load(open(path))
    rows = {(s["model"], s["system"]): s for s in d["summary"]}

    def step(m, s):
        return rows[(m, s)]["step_seconds"]

    def peak(m, s):
        return rows[(m, s)]["peak_anon_bytes"] / 2**30

    def first(m, s):
        return rows[(m, s)]["first_call_seconds"]

    def bold(x, best, fmt):
        return f"**{x:{fmt}}**" if x == best else f"{x:{fmt}}"

    fp32 = [m for m in NAMES if all((m, s) in rows for s in FP32)]
    if fp32:
        print("| model | step s: eager / compile / compile-max / graft hook / graft step | graft step / compile's best"
              " | graft step / eager | peak anon GiB: eager / compile / compile-max / graft hook / graft step"
              " | first call s: eager / compile / compile-max / graft step | GEMM ceiling: eager / compile's best / graft step |")
        print("|---|---|---|---|---|---|---|")
    for m in fp32:
        steps, peaks = [step(m, s) for s in FP32], [peak(m, s) for s in FP32]
        best_compile = min(("compile", "compile-max"), key=lambda s: step(m, s))
        share = {s: rows[(m, s)].get("gemm_fraction", float("nan")) for s in ("eager", best_compile, "graft-step")}
        print(f"| {NAMES[m]} | " + " / ".join(bold(x, min(steps), ".2f") for x in steps)
              + f" | {step(m, 'graft-step') / step(m, best_compile):.2f} | {step(m, 'graft-step') / step(m, 'eager'):.2f} | "
              + " / ".join(bold(x, min(peaks), ".2f") for x in peaks) + " | "
              + " / ".join(f"{first(m, s):.1f}" for s in ("eager", "compile", "compile-max", "graft-step"))
              + f" | {100 * share['eager']:.0f}% / {100 * share[best_compile]:.0f}% / {100 * share['graft-step']:.0f}% |")
    bf16 = [m for m in NAMES if all((m, s) in rows for s in BF16)]
    if bf16:
        print()
        print("| model | bf16 step s: eager / compile / graft | graft / compile | bf16 peak anon GiB: eager / compile / graft"
              " | graft / compile | bf16 first call s: eager / compile / graft | first losses: eager / compile / graft |")
        print("|---|---|---|---|---|---|---|")
    for m in bf16:
        steps, peaks = [step(m, s) for s in BF16], [peak(m, s) for s in BF16]
        print(f"| {NAMES[m]} | " + " / ".join(bold(x, min(steps), ".2f") for x in steps)
              + f" | {step(m, 'graft-bf16') / step(m, 'compile-bf16'):.2f} | "
              + " / ".join(bold(x, min(peaks), ".2f") for x in peaks)
              + f" | {peak(m, 'graft-bf16') / peak(m, 'compile-bf16'):.2f} | "
              + " / ".join(f"{first(m, s):.1f}" for s in BF16) + " | "
              + " / ".join(f"{rows[(m, s)]['loss']:.4f}" for s in BF16) + " |")
    print()
    for (m, s), r in rows.items():
        print(m, s, "step rounds", [round(x, 2) for x in r.get("step_seconds_rounds", [])], "ok", r["ok"])


if __name__ == "__main__":
    main(sys.argv[1])
