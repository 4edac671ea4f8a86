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
import shutil
import statistics
import sys
import tempfile

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


PACK = ROOT / "examples" / "patch-pack"
GROUP = "hf_train_shim.patches"
TARGETS = "hf_train_shim.targets"


def pack_site(directory: str) -> str:
    """``directory`` holding examples/patch-pack as an install lays it out (its package and a
    dist-info folder with both entry-point groups), without a build: what discovery reads is all there."""
    shutil.copytree(PACK / "src" / "shim_example_pack", os.path.join(directory, "shim_example_pack"))
    text = (PACK / "pyproject.toml").read_text()
    groups = {
        group: [line.replace('"', "") for line in text.split(f'[project.entry-points."{group}"]', 1)[1].split("\n[", 1)[0].splitlines() if "=" in line]
        for group in (GROUP, TARGETS)
    }  # fmt: skip
    return write_distribution(directory, "shim-example-pack", groups)


def write_distribution(directory: str, name: str, groups: dict[str, list[str]], filler: int = 0) -> str:
    """A dist-info folder of ``name`` in ``directory`` whose entry_points.txt has ``groups`` (and
    ``filler`` bytes of comment before them)."""
    metadata = os.path.join(directory, f"{name.replace('-', '_')}-0.1.0.dist-info")
    os.mkdir(metadata)
    with open(os.path.join(metadata, "METADATA"), "w") as file:
        file.write(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n")
    with open(os.path.join(metadata, "entry_points.txt"), "w") as file:
        file.write(("# " + "x" * 78 + "\n") * (filler // 81))
        file.write("".join(f"[{group}]\n" + "\n".join(lines) + "\n\n" for group, lines in groups.items()))
    return directory


def many_packs(directory: str, count: int = 50) -> str:
    """``directory`` with ``count`` packs, each a module with one patch on a module of its own,
    its target listed: installed, as far as ``import shim`` can tell."""
    for index in range(count):
        package = os.path.join(directory, f"bench_pack{index}")
        os.mkdir(package)
        for module in ("__init__", "target"):
            open(os.path.join(package, f"{module}.py"), "w").close()
        with open(os.path.join(package, "fixes.py"), "w") as file:
            file.write(
                "from shim import Patch, Target\n"
                f"PATCH = Patch(name='bench-fix{index}', summary='s', distribution='bench-pack{index}', "
                f"requires='>=0', targets=(Target('bench_pack{index}.target:f', lambda w, i, a, k: w(*a, **k)),))\n"
            )
        groups = {
            GROUP: [f"bench-fix{index} = bench_pack{index}.fixes:PATCH"],
            TARGETS: [f"bench-fix{index}.bench_pack{index}.target = bench_pack{index}.target"],
        }
        write_distribution(directory, f"bench-pack{index}", groups)
    return directory


def huge_entry_points(directory: str) -> str:
    """``directory`` with one distribution that declares console scripts in a 50 MB entry_points.txt."""
    return write_distribution(directory, "huge", {"console_scripts": ["huge = huge:main"]}, filler=50 << 20)


def crowded_site(directory: str, count: int) -> str:
    """``directory`` with ``count`` distributions, one in four declaring console scripts: a big
    environment, as far as entry-point discovery can tell."""
    for index in range(count):
        metadata = os.path.join(directory, f"dist{index}-1.0.dist-info")
        os.mkdir(metadata)
        with open(os.path.join(metadata, "METADATA"), "w") as file:
            file.write(f"Metadata-Version: 2.1\nName: dist{index}\nVersion: 1.0\n")
        if index % 4 == 0:
            with open(os.path.join(metadata, "entry_points.txt"), "w") as file:
                file.write(f"[console_scripts]\ndist{index} = dist{index}.cli:main\n")
    return directory


def discovery(site: str | None, rounds: int) -> dict:
    """CPU ms of finding the packs in a fresh interpreter (``site`` added to ``sys.path``): the shim's
    ``packs.found()`` (its first call, then the median of repeats), and ``importlib.metadata``'s
    ``entry_points(group=...)`` with the import it needs, for comparison."""
    path = child_env(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), site])))
    found = [time_import("found()", before="from shim.packs import found", env=path) for _ in range(rounds)]
    repeated = time_import("for _ in range(100): found()", before="from shim.packs import found", env=path)
    metadata = [
        time_import(f"import importlib.metadata as m\nm.entry_points(group={GROUP!r})", before="import shim", env=path)
        for _ in range(rounds)
    ]
    return {
        "found": quartiles([r["s"][0] for r in found]),
        "found_repeated": repeated["s"][0] / 100,
        "metadata": quartiles([r["s"][0] for r in metadata]),
        "distributions": int(distribution_count(path)),
    }


def distribution_count(env: dict) -> int:
    """How many distributions ``importlib.metadata`` sees with ``env``."""
    code = "import importlib.metadata as m\nimport json\nprint('RESULT ' + json.dumps(len(list(m.distributions()))))"
    return run_child([sys.executable, "-c", code], env)


#: The environments ``import shim`` is timed in against none of them, and how each is built.
SITES = {
    "examples/patch-pack installed": pack_site,
    "50 packs installed": many_packs,
    "a 50 MB unrelated entry_points.txt": huge_entry_points,
}
#: What runs, untimed, before ``import shim`` on both sides: a distribution that declares a pack is
#: parsed by ``importlib.metadata``, which transformers (and torch) import anyway; the first site is
#: also timed in a bare interpreter, where the pack pays that import itself.
AS_IN_A_RUN = "import importlib.metadata"
BARE = "examples/patch-pack installed, nothing imported before"


def measure_packs(args, log) -> dict:
    """``import shim`` with packs installed (or a huge unrelated file) against without, and the cost
    of discovery alone, in this environment and in one of 1000 more distributions."""
    out: dict = {"imports": {}}
    rounds = max(args.import_rounds, 6)
    for label, build in SITES.items():
        with tempfile.TemporaryDirectory() as directory:
            site = build(directory)
            log(f"import shim, {label}")
            out["imports"][label] = pack_cost(site, rounds, AS_IN_A_RUN)
            if label.startswith("examples"):
                out["imports"][BARE] = pack_cost(site, rounds, "")
                log("entry-point discovery")
                out["discovery"] = discovery(None, rounds)
                out["discovery_pack"] = discovery(site, rounds)
    with tempfile.TemporaryDirectory() as directory:
        out["discovery_crowded"] = discovery(crowded_site(directory, 1000), rounds)
    return out


def pack_cost(site: str, rounds: int, before: str) -> dict:
    """``import shim`` with the packs in ``site`` against without them (``before`` run first, untimed,
    on both sides), and the modules the packs add."""
    with_site, without = interleave(
        lambda: time_import("import shim", before, env=child_env(PYTHONPATH=f"{ROOT}{os.pathsep}{site}")),
        lambda: time_import("import shim", before),
        rounds,
    )
    result = compare([r["s"] for r in with_site], [r["s"] for r in without])
    result["modules"] = sorted(set(with_site[0]["new"]) - set(without[0]["new"]))
    result["added"] = quartiles([a["s"][0] - b["s"][0] for a, b in zip(with_site, without)])
    return result


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
        "early": sorted(
            m for m in new if m.startswith(("shim.patches.", "shim.checkpointing", "wrapt", "packaging.specifiers"))
        ),
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
    out["packs"] = measure_packs(args, log)
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
    return out + report_packs(imports["packs"])


def report_packs(packs: dict) -> list[str]:
    """The patch-pack lines: import shim with packs installed against none, and what discovery costs."""
    rows = [comparison_row(f"import shim, {label} (off: none)", r, 1e3) for label, r in packs["imports"].items()]
    out = [table(rows, HEADERS)]
    for label, result in packs["imports"].items():
        q = result["added"]
        target = ", target within 5 ms: " + ("met" if q[1] < 0.005 else "MISSED") if label.startswith("50") else ""
        out.append(
            f"{label}: import shim {q[1] * 1e3:+.1f} ms CPU (IQR {q[0] * 1e3:+.1f}..{q[2] * 1e3:+.1f}){target}; "
            f"modules it adds: {', '.join(result['modules']) or 'none'}"
        )
    for key, label in (
        ("discovery", "this environment"),
        ("discovery_pack", "this environment and the pack"),
        ("discovery_crowded", "this environment and 1000 more distributions"),
    ):
        d = packs[key]
        out.append(
            f"finding the packs, {label} ({d['distributions']} distributions): shim.packs.found() "
            f"{d['found'][1] * 1e3:.2f} ms CPU first call (IQR {d['found'][0] * 1e3:.2f}-{d['found'][2] * 1e3:.2f}), "
            f"{d['found_repeated'] * 1e3:.2f} ms repeated; importlib.metadata.entry_points(group=...) with its "
            f"import {d['metadata'][1] * 1e3:.2f} ms"
        )
    return out
