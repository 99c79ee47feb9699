"""Opcode mix of the main loop of CUDA kernels in a cubin (no GPU needed).

    python -m benchmarks.sass_loop_mix FILE.cubin|FILE.sass 'regex on the mangled kernel name'

A cubin comes from `cuobjdump -xelf all build/temp.*/csrc/attention_cuda.o` (Triton bundles
cuobjdump; the CUDA install here has only nvcc / ptxas), or `nvcc -cubin`.  For each matching
kernel the backward branch with the widest span is taken as its main loop: prints the loop's
static instruction count, its opcode histogram, and how many instructions lie between its
barriers and wgmma issues / waits, so that a change's effect on the work per tile (and on what
overlaps the tensor cores) can be read before a GPU runs it (benchmarks/NOTES.md, 2026-11-27).
Static counts include both sides of every branch inside the loop.
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys

def sass_text(path: str) -> str:
    if path.endswith(".sass"):
        with open(path) as f:
            return f.read()
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout


_INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
_BACKWARD_TARGET = re.compile(r"BRA\s+(?:`\()?\s*0x([0-9a-f]+)")


def functions(text: str):
    """(mangled name, [(address, instruction text)]) per kernel of a cuobjdump -sass listing."""
    name, body = None, []
    for line in text.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            if name:
                yield name, body
            name, body = m.group(1), []
        elif name:
            mi = _INSTRUCTION.match(line)
            if mi:
                body.append((int(mi.group(1), 16), mi.group(2).strip()))
    if name:
        yield name, body


def opcode(instruction: str) -> str:
    tokens = instruction.split()
    if tokens and tokens[0].startswith("@"):  # predicate guard
        tokens = tokens[1:]
    return tokens[0].split(".")[0] if tokens else "?"


def _is_mark(instruction: str) -> bool:
    return "DEPBAR" in instruction or "BAR.SYNC" in instruction or (instruction.startswith("HGMMA") and "gsb0" in instruction)


def report(text: str, pattern: str) -> str:
    out, pat = [], re.compile(pattern)
    for name, body in functions(text):
        if not pat.search(name):
            continue
        loop_span = None
        for addr, ins in body:
            m = _BACKWARD_TARGET.search(ins)
            if m and int(m.group(1), 16) < addr:
                span = (int(m.group(1), 16), addr)
                if loop_span is None or span[1] - span[0] > loop_span[1] - loop_span[0]:
                    loop_span = span
        if loop_span is None:
            out.append(f"{name}: no loop")
            continue
        loop = [(a, i) for a, i in body if loop_span[0] <= a <= loop_span[1]]
        mix = collections.Counter(opcode(i) for _, i in loop)
        out.append(f"{name}\n  loop 0x{loop_span[0]:x}-0x{loop_span[1]:x}: {len(loop)} instructions")
        out.append("  " + " ".join(f"{k}:{v}" for k, v in mix.most_common()))
        prev = loop_span[0]
        for a, i in loop:
            if _is_mark(i):
                out.append(f"    {sum(1 for x, _ in loop if prev <= x < a):4d} instr, then {i}")
                prev = a
        out.append(f"    {sum(1 for x, _ in loop if x >= prev):4d} instr to the loop's end")
    return "\n".join(out)


if __name__ == "__main__":
    print(report(sass_text(sys.argv[1]), sys.argv[2]))
