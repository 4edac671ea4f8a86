"""Import cost (report section 1-2): what ``import shim`` adds, in fresh interpreters.

Each import runs in a child interpreter with the bytecode caches warm; the timed statement's CPU
time is compared with the shim on against ``SHIM_DISABLE=all`` (or no ``import shim`` at all),
alternating ABBA. Two differences of whole imports are noisy, so the same cost is also measured
directly: the CPU time of ``import shim`` in an interpreter that has already imported transformers
(the patches wait), and after the model classes (every patch applies on the spot). The modules
``import shim`` loads are listed: nothing heavy, and no patch module, wrapt or packaging before a
target module is imported.
"""

from __future__ import annotations

import os
import statistics
import sys

from harness import HEADERS, ROOT, child_env, compare, comparison_row, interleave, quartiles, run_child, table, verdict

HEAVY = ("torch", "transformers", "trl", "peft", "accelerate", "numpy")


def time_import(statement: str, before: str = "", env: dict | None = None) -> dict:
    """Seconds to run ``statement`` in a fresh interpreter (after ``before``, untimed), and its modules."""
    code = (
        f"import sys, time\nfirst = time.process_time()\n{before}\nfirst = time.process_time() - first\n"
        "loaded = set(sys.modules)\n"
        f"cpu, wall = time.process_time(), time.perf_counter()\n{statement}\n"
        "elapsed = [time.process_time() - cpu, time.perf_counter() - wall]\n"
        "import json\nshim = sys.modules.get('shim')\n"
        "print('RESULT ' + json.dumps({'s': elapsed, 'before': first, 'new': sorted(set(sys.modules) - loaded),"
        " 'shim_file': getattr(shim, '__file__', None)}))\n"
    )
    return run_child([sys.executable, "-c", code], env or child_env())


def marginal(runs: list) -> dict:
    """CPU seconds of the timed statement, of what ran before it, and the ratio they imply."""
    cost = statistics.median(r["s"][0] for r in runs)
    base = statistics.median(r["before"] for r in runs)
    return {"cost": quartiles([r["s"][0] for r in runs]), "base": base, "ratio": (base + cost) / base}


def measure(args, log) -> dict:
    out = {}
    # Bytecode caches warm, as after any first run (this environment may set PYTHONDONTWRITEBYTECODE).
    import compileall

    for package in ("shim", "patches"):  # the repository folders (patches/ is installed as shim.patches)
        compileall.compile_dir(str(ROOT / package), quiet=1)
    time_import("import shim, transformers")

    log("import shim alone")
    on, off = interleave(
        lambda: time_import("import shim"),
        lambda: time_import("import shim", env=child_env(SHIM_DISABLE="all")),
        args.import_rounds,
    )
    out["shim"] = compare([r["s"] for r in on], [r["s"] for r in off])
    new = on[0]["new"]
    stdlib = getattr(sys, "stdlib_module_names", frozenset())
    out["shim_modules"] = {
        "count": len(new),
        "third_party": sorted({m.split(".")[0] for m in new} - set(stdlib) - {"shim", "patches"}),
        "heavy": sorted(m for m in HEAVY if m in new),
        "early": sorted(m for m in new if m.startswith(("shim.patches.", "wrapt", "packaging.specifiers"))),
        "file": os.path.relpath(on[0]["shim_file"], ROOT) if on[0]["shim_file"] else None,
    }

    log("import shim, transformers")
    with_shim, without, disabled = [], [], []
    for index in range(args.import_rounds):
        runs = [
            (lambda: time_import("import transformers"), without),
            (lambda: time_import("import shim, transformers"), with_shim),
            (lambda: time_import("import shim, transformers", env=child_env(SHIM_DISABLE="all")), disabled),
        ]
        for run, into in runs if index % 2 == 0 else reversed(runs):
            into.append(run()["s"])
    out["transformers"] = compare(with_shim, without)
    out["transformers_disabled"] = compare(disabled, without)

    # The same cost measured directly, far less noisy than a difference of two import times: the
    # CPU time of ``import shim`` in an interpreter that has already imported the rest.
    log("import shim after transformers (marginal cost)")
    runs = [time_import("import shim", before="import transformers") for _ in range(args.import_rounds)]
    out["marginal_transformers"] = marginal(runs)
    # After the model classes are imported every transformers target is there: activation applies
    # the patches on the spot (gate, probe, wrap), so this is the whole cost of applying them.
    before = "import warnings; warnings.simplefilter('ignore')\nfrom transformers import LlamaForCausalLM"
    runs = [time_import("import shim", before=before) for _ in range(max(2, args.import_rounds // 3))]
    out["marginal_applied"] = marginal(runs)
    return out


def report(args, imports: dict) -> list[str]:
    out = []
    m = imports["shim_modules"]
    out.append("1-2. Import, fresh interpreters, bytecode cached (ms); off = SHIM_DISABLE=all, or no shim at all")
    rows = [
        comparison_row("import shim (off: SHIM_DISABLE=all)", imports["shim"], 1e3),
        comparison_row(
            "import shim, transformers (off: import transformers)", imports["transformers"], 1e3, "import", args.quick
        ),
        comparison_row("  SHIM_DISABLE=all import shim, transformers", imports["transformers_disabled"], 1e3),
    ]
    out.append(table(rows, HEADERS))
    for key, label, kind in (
        ("marginal_transformers", "import shim after import transformers (patches wait)", "import"),
        ("marginal_applied", "import shim after from transformers import LlamaForCausalLM (patches applied)", None),
    ):
        q, ratio = imports[key]["cost"], imports[key]["ratio"]
        out.append(
            f"{label}: {q[1] * 1e3:.1f} ms CPU (IQR {q[0] * 1e3:.1f}-{q[2] * 1e3:.1f}) on top of "
            f"{imports[key]['base'] * 1e3:.0f} ms: ratio {ratio:.3f}"
            + (f", target {verdict({'ratio': ratio, 'ratio_q25': ratio}, kind, args.quick)}" if kind else "")
        )
    out.append(
        f"import shim loads {m['count']} modules; outside the standard library: "
        f"{', '.join(m['third_party']) or 'none'}; torch/transformers/trl/peft/accelerate/numpy: "
        f"{', '.join(m['heavy']) or 'none'} (shim from {m['file']})"
    )
    out.append(
        f"import shim imports a patch module, wrapt or packaging.specifiers before a target is imported: "
        f"{', '.join(m['early']) or 'none'}"
    )
    return out
