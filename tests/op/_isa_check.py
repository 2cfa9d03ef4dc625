"""Which instruction-set level each function of a built x86-64 module uses, from its disassembly.

The CPU kernels have three paths (csrc/cpu_simd.h): generic (baseline x86-64: SSE2 at most), AVX2
(+ FMA + F16C) and AVX-512 (F, BW, VL). A function belongs to a path by its name: `..._avx512`
to AVX-512, `..._avx2` to AVX2, every other function (pybind11, the checks, the portable loops,
OpenMP's outlined bodies) to the baseline. What a function may use:

- baseline: no VEX or EVEX encoding, no YMM/ZMM/opmask register, no SSE3/SSSE3/SSE4 mnemonic;
- AVX2: no EVEX encoding (every AVX-512 instruction, also on XMM/YMM), no ZMM, no XMM/YMM 16-31,
  no opmask register (AVX-512's k0-k7, whose moves are VEX-encoded);
- AVX-512: anything.

Encodings are read from the bytes, not guessed from mnemonics: in 64-bit mode a first opcode byte
0x62 (after legacy prefixes) is always EVEX, 0xC4/0xC5 always VEX. This depends only on the
module, not on the CPU that runs the check.

Run as a script: ``python tests/op/_isa_check.py path/to/_C.so`` prints each violation.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field

LEVELS = ("generic", "avx2", "avx512")
_LEGACY_PREFIXES = {0x26, 0x2E, 0x36, 0x3E, 0x64, 0x65, 0x66, 0x67, 0xF0, 0xF2, 0xF3}
_FUNC = re.compile(r"^[0-9a-f]+ <(?P<name>.+)>:$")
_INSN = re.compile(r"^\s*[0-9a-f]+:\t(?P<bytes>(?:[0-9a-f]{2} )+)\s*\t?(?P<text>.*)$")
_ISA_NAME = re.compile(r"[A-Za-z0-9]_(avx2|avx512)\b")
_ZMM = re.compile(r"%zmm\d+")
_HIGH_XY = re.compile(r"%[xy]mm(1[6-9]|2\d|3[01])\b")
_OPMASK = re.compile(r"%k[0-7]\b")
_YMM = re.compile(r"%ymm\d+")
# SSE3, SSSE3, SSE4.1, SSE4.2 (legacy-encoded; their VEX forms are caught by the encoding).
_ABOVE_SSE2 = frozenset(["addsubpd", "addsubps", "haddpd", "haddps", "hsubpd", "hsubps", "lddqu", "movddup", "movshdup", "movsldup", "pabsb", "pabsd", "pabsw", "palignr", "phaddd", "phaddsw", "phaddw", "phsubd", "phsubsw", "phsubw", "pmaddubsw", "pmulhrsw", "pshufb", "psignb", "psignd", "psignw", "blendpd", "blendps", "blendvpd", "blendvps", "dppd", "dpps", "extractps", "insertps", "movntdqa", "mpsadbw", "packusdw", "pblendvb", "pblendw", "pcmpeqq", "pextrb", "pextrd", "pextrq", "phminposuw", "pinsrb", "pinsrd", "pinsrq", "pmaxsb", "pmaxsd", "pmaxud", "pmaxuw", "pminsb", "pminsd", "pminud", "pminuw", "pmovsxbd", "pmovsxbq", "pmovsxbw", "pmovsxdq", "pmovsxwd", "pmovsxwq", "pmovzxbd", "pmovzxbq", "pmovzxbw", "pmovzxdq", "pmovzxwd", "pmovzxwq", "pmuldq", "pmulld", "ptest", "roundpd", "roundps", "roundsd", "roundss", "pcmpestri", "pcmpestrm", "pcmpistri", "pcmpistrm", "pcmpgtq", "crc32"])


def level_of(name: str) -> str:
    """The path a function belongs to, from its (demangled) name."""
    found = {m.group(1) for m in _ISA_NAME.finditer(name)}
    return "avx512" if "avx512" in found else "avx2" if "avx2" in found else "generic"


def encoding(raw: list[int]) -> str:
    """'evex', 'vex' or 'legacy' for one instruction's bytes (64-bit mode)."""
    i = 0
    while i < len(raw) and raw[i] in _LEGACY_PREFIXES:
        i += 1
    if i < len(raw) and raw[i] == 0x62:
        return "evex"
    if i < len(raw) and raw[i] in (0xC4, 0xC5):
        return "vex"
    return "legacy"


def violation(level: str, raw: list[int], text: str) -> str | None:
    """Why an instruction is above `level`, or None."""
    if level == "avx512":
        return None
    enc = encoding(raw)
    if enc == "evex":
        return "EVEX-encoded (AVX-512)"
    if _ZMM.search(text) or _HIGH_XY.search(text):
        return "an AVX-512 register"
    if _OPMASK.search(text):
        return "an opmask register (AVX-512)"
    if level == "avx2":
        return None
    if enc == "vex":
        return "VEX-encoded (AVX)"
    if _YMM.search(text):
        return "a YMM register (AVX)"
    mnemonic = text.split()[0] if text.split() else ""
    if mnemonic in _ABOVE_SSE2:
        return "above SSE2 (SSE3/SSSE3/SSE4)"
    return None


@dataclass
class Report:
    """Per function: its path and how many instructions it has; the violations; the functions
    with ZMM code per path (to show that a path exists)."""
    functions: dict[str, str] = field(default_factory=dict)
    violations: list[tuple[str, str, str, str]] = field(default_factory=list)
    uses: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(dict))

    def functions_of(self, level: str) -> list[str]:
        return [f for f, lv in self.functions.items() if lv == level]


def objdump() -> str:
    path = shutil.which("objdump")
    if path is None:
        raise RuntimeError("objdump not found: install binutils")
    return path


def check(module_path: str) -> Report:
    """Disassemble every executable section of `module_path` and classify each instruction."""
    out = subprocess.run([objdump(), "-d", "-C", "--insn-width=16", "-w", module_path],
                         capture_output=True, text=True, check=True).stdout
    if " <" not in out or "no symbols" in out:
        raise RuntimeError(f"{module_path} has no symbol table: the check reads functions by name")
    report = Report()
    name, level = None, "generic"
    for line in out.splitlines():
        m = _FUNC.match(line)
        if m:
            name = m.group("name")
            level = level_of(name)
            report.functions[name] = level
            continue
        m = _INSN.match(line)
        if m is None or name is None:
            continue
        raw = [int(b, 16) for b in m.group("bytes").split()]
        text = m.group("text").strip()
        for reg, pattern in (("zmm", _ZMM), ("ymm", _YMM)):
            if pattern.search(text):
                report.uses[name][reg] = report.uses[name].get(reg, 0) + 1
        why = violation(level, raw, text)
        if why is not None:
            report.violations.append((level, name, text, why))
    return report


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/op/_isa_check.py MODULE.so", file=sys.stderr)
        return 2
    report = check(argv[0])
    for level in LEVELS:
        print(f"{level}: {len(report.functions_of(level))} functions")
    for level, name, text, why in report.violations:
        print(f"{level} path {name}: {text}  <- {why}")
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
