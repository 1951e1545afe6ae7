"""The code's shape: stages are rooms over a shared floor, and every function fits on a screen."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# every stage is a folder with a KFP component in it
STAGES = tuple(sorted(p.parent.name for p in (ROOT / "components").glob("*/component.py")))
MAX_FUNCTION_LINES = 80
FLOOR_ROOMS = ("config", "models", "parallel", "precision", "store")  # the shared floor's folders


def _sources(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py"))


def _package(path: Path) -> list[str]:
    return list(path.relative_to(ROOT).with_suffix("").parts[:-1])


DYNAMIC_IMPORTERS = {"import_module", "__import__", "run_module"}  # importlib's, the builtin, runpy's
DYNAMIC = "*"  # a module name's part only known at run time: `components.*` may be any stage


def _static_prefix(node: ast.expr) -> tuple[str, bool]:
    """What an expression's string value is known to start with, and whether that is all of it:
    constants, f-strings, `+`, `%` and `.format` on a constant."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value, True
    if isinstance(node, ast.JoinedStr):
        text = ""
        for part in node.values:
            if not (isinstance(part, ast.Constant) and isinstance(part.value, str)):
                return text, False
            text += part.value
        return text, True
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, whole = _static_prefix(node.left)
        if not whole:
            return left, False
        right, whole = _static_prefix(node.right)
        return left + right, whole
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        left, _ = _static_prefix(node.left)
        return left.split("%", 1)[0], False
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
        left, _ = _static_prefix(node.func.value)
        return left.split("{", 1)[0], False
    return "", False


def _dynamic_import(node: ast.Call, path: Path) -> str | None:
    """The module a call to importlib.import_module / __import__ / runpy.run_module names, as far
    as the source spells it: a prefix known only up to a run-time part ends in `.*`."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in DYNAMIC_IMPORTERS or not node.args:
        return None
    text, whole = _static_prefix(node.args[0])
    if text.startswith("."):  # relative to the package argument, in practice the file's own (__package__)
        dots = len(text) - len(text.lstrip("."))
        package = _package(path)[: len(_package(path)) - (dots - 1)]
        text = ".".join([*package, text[dots:]]) if text[dots:] or not whole else ".".join(package)
    if not text and not whole:
        return None  # nothing static: a name from config (a plugin), not this tree's layout
    if whole:
        return text
    # a run-time part follows: a part spelled only in part (`components.tr{x}`) may be any module
    known = text.rsplit(".", 1)[0] if "." in text else ""
    return f"{known}.{DYNAMIC}" if known else DYNAMIC


def _imported_modules(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """Every module a file names: import statements anywhere (relative ones resolved against
    the file's package), the first argument of importlib.import_module / __import__ /
    runpy.run_module (constants, f-strings and concatenations: a part known only at run time is
    `*`), and string constants that spell a liftoff module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _package(path)[: len(_package(path)) - (node.level - 1)]
                base = ".".join([*package, *([base] if base else [])])
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Call) and (module := _dynamic_import(node, path)) is not None:
            found.append((node.lineno, module))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"components(\.\w+)+", node.value):
                found.append((node.lineno, node.value))
    return found


def _stages_named(module: str) -> set[str]:
    """The stages a module name may be in: its stage, or every stage where that part is `*`."""
    parts = module.split(".")
    if module == DYNAMIC or parts[:2] == ["components", DYNAMIC]:
        return set(STAGES)
    return {parts[1]} if parts[0] == "components" and len(parts) > 1 and parts[1] in STAGES else set()


def test_stages_are_found():
    assert {"tokenize", "preflight", "train", "validate", "evaluate"} <= set(STAGES)


def test_no_stage_imports_another_stage():
    sideways = []
    for path in _sources("components"):
        rel = path.relative_to(ROOT / "components")
        own = rel.parts[0] if len(rel.parts) > 1 else None
        for line, module in _imported_modules(path):
            if _stages_named(module) - {own}:
                sideways.append(f"components/{rel}:{line} imports {module}")
    assert not sideways, "stages import the shared floor, never each other:\n" + "\n".join(sideways)


def test_the_floor_imports_no_stage():
    """components/*.py and config/, parallel/, precision/, store/ (the floor) stand under the stages."""
    floor = [*(ROOT / "components").glob("*.py")]
    floor += [p for room in FLOOR_ROOMS for p in (ROOT / "components" / room).glob("*.py")]
    upward = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sorted(floor)
        for line, module in _imported_modules(path)
        if _stages_named(module)
    ]
    assert not upward, "\n".join(upward)


def test_the_import_scan_sees_dynamic_imports():
    """importlib, __import__ and runpy calls count as imports, down to the part known statically."""
    snippet = """
import importlib
from importlib import import_module
def load(x, name):
    importlib.import_module(f"components.{x}.stage")
    importlib.import_module(f"components.train.{x}")
    import_module("components." + x)
    importlib.import_module("components.tr" + x)
    __import__("components.evaluate.report")
    __import__("components.{}.worker".format(x))
    importlib.import_module("components.%s" % x)
    importlib.import_module(".checks", __package__)
    importlib.import_module(name)
"""
    path = ROOT / "components" / "preflight" / "snippet.py"  # never written: only its package matters
    found: dict[int, set[str]] = {}
    for line, module in _imported_modules(path, snippet):
        found.setdefault(line, set()).add(module)
    assert found == {
        2: {"importlib"},
        3: {"importlib", "importlib.import_module"},
        5: {"components.*"},
        6: {"components.train.*"},
        7: {"components.*"},
        8: {"components.*", "components.tr"},  # the constant too: harmless, no stage is "tr"
        9: {"components.evaluate.report"},
        10: {"components.*"},
        11: {"components.*"},
        12: {"components.preflight.checks"},
    }, found  # line 13: a name from config, nothing static to check
    assert _stages_named("components.*") == set(STAGES) and _stages_named("components.train.*") == {"train"}
    assert _stages_named("components.preflight.checks") == {"preflight"} and not _stages_named("components.store")


def test_no_function_is_longer_than_a_screen():
    long = []
    for path in _sources("components", "pipelines"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} has {lines} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_one_code_version_helper():
    """Only components/store/keys.py asks git which code this is (manifests and uploaded versions)."""
    askers = [
        str(path.relative_to(ROOT))
        for path in _sources("components", "pipelines")
        if re.search(r"""["']git["']""", path.read_text())
    ]
    assert askers == ["components/store/keys.py"], askers


def _readme_layout() -> dict[str, str]:
    """docs/layout.md's layout block (the README links it) as {entry path: its description,
    continuation lines included}."""
    block = (ROOT / "docs" / "layout.md").read_text().split("```", 2)[1]
    entries, parent, last = {}, "", None
    for line in block.splitlines():
        if not line.strip():
            continue
        name = line.split()[0]
        if line.startswith(" " * 10) and last:  # a continuation of the entry above
            entries[last] += " " + line.strip()
            continue
        path = name if not line.startswith(" ") else parent + name
        if not line.startswith(" "):
            parent = name
        entries[path], last = line[len(line) - len(line.lstrip()) + len(name) :].strip(), path
    return entries


def test_readme_layout_matches_the_tree():
    """Every entry docs/layout.md's layout names exists; every floor module, folder and pipelines
    module is named; and each stage's (and precision/'s) line names exactly its modules."""
    entries = _readme_layout()
    missing = [e for e in entries if (e.endswith("/") or e.endswith(".py")) and not (ROOT / e).exists()]
    assert not missing, f"docs/layout.md names what is not there: {missing}"
    expected = [f"components/{p.name}" for p in (ROOT / "components").glob("*.py") if p.name != "__init__.py"]
    expected += [f"pipelines/{p.name}" for p in (ROOT / "pipelines").glob("*.py") if p.name != "__init__.py"]
    expected += [f"components/{d.name}/" for d in (ROOT / "components").iterdir() if (d / "__init__.py").exists()]
    unnamed = [e for e in expected if e not in entries]
    assert not unnamed, f"docs/layout.md does not name: {unnamed}"
    for folder in [*STAGES, "precision"]:
        words = set(re.findall(r"\w+", entries[f"components/{folder}/"].replace(".py", "")))
        modules = {p.stem for p in (ROOT / "components" / folder).glob("*.py") if p.name != "__init__.py"}
        assert modules <= words, f"docs/layout.md's components/{folder}/ line does not name {sorted(modules - words)}"
        listed = set(re.findall(r"(\w+)\.py", entries[f"components/{folder}/"]))
        assert listed <= modules, f"docs/layout.md's components/{folder}/ line names {sorted(listed - modules)}: gone"


def test_the_project_refers_to_nothing_outside_its_clone():
    """A clone has no `../shared/`: the design lives in docs/design.md, which the README names."""
    text_files = [
        ROOT / "README.md",
        ROOT / "Makefile",
        *ROOT.glob("docs/*.md"),
        *(p for p in ROOT.glob("deploy/**/*") if p.is_file()),
    ]
    text_files += [*ROOT.glob("components/**/*.py"), *ROOT.glob("pipelines/*.py"), *ROOT.glob("conf/**/*.yaml")]
    outside = [str(p.relative_to(ROOT)) for p in text_files if "../shared" in p.read_text()]
    assert outside == [], f"refer outside the clone: {outside}"
    assert (ROOT / "docs" / "design.md").is_file() and "docs/design.md" in (ROOT / "README.md").read_text()


def test_the_quickstart_is_the_readmes_first_section():
    sections = re.findall(r"^## (.+)$", (ROOT / "README.md").read_text(), flags=re.M)
    assert sections and sections[0].lower().startswith("quickstart"), sections[:3]


REGEX_CALLS = {"compile", "search", "match", "fullmatch", "findall", "finditer", "sub", "subn", "split"}
LEVELS = {"debug": "DEBUG", "info": "INFO", "warning": "WARNING", "error": "ERROR", "exception": "ERROR"}
PRINTS = {"print", "say", "write"}


def _text(node: ast.expr) -> str | None:
    """A string expression as it reads with its values filled in (`%s`, `{x}` -> 7)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return re.sub(r"%[-\d.]*[sdfgr]", "7", node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(p.value if isinstance(p, ast.Constant) else "7" for p in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mod)):
        left = _text(node.left)
        right = _text(node.right) if isinstance(node.op, ast.Add) else ""
        return None if left is None or right is None else left + right
    return None


def _as_logged(path: Path, level: str | None, text: str) -> list[str]:
    """A text as its line reads in a log: bare, and under the log formats of the stages'
    processes (components/task.py's and the replicas', components/launcher.py's)."""
    if level is None:
        return [text]
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts) if path.is_relative_to(ROOT) else path.stem
    stamp = "2026-12-03 12:00:00,000"
    return [text, f"{stamp} {level} {module}: {text}", f"[0]:{stamp} rank0 {level} {module}: {text}"]


def _regexes_and_log_texts(path: Path) -> tuple[list[str], list[str]]:
    """The regex literals a module matches with (`re.*` calls), and the texts it may log, print
    or raise as they read: every string literal and f-string of two words or more (a line is
    often built from parts: `"  ".join([f"step {s}/{n}", ...])`) that is not a docstring or a
    regex, and the ones a log call takes also under the log formats."""
    tree = ast.parse(path.read_text())
    regexes, texts, skip = [], [], set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                skip.add(id(first.value))
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            node = ast.Call(func=ast.Name("print"), args=node.exc.args[:1], keywords=[])
        if not (isinstance(node, ast.Call) and node.args):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        owner = getattr(func, "value", None)
        if name in REGEX_CALLS and isinstance(owner, ast.Name) and owner.id == "re":
            skip.update(id(n) for n in ast.walk(node.args[0]))
            if (pattern := _text(node.args[0])) is not None:
                regexes.append(pattern)
        elif name in {*LEVELS, *PRINTS} and (said := _text(node.args[0])) is not None and " " in said.strip():
            texts += _as_logged(path, LEVELS.get(name), said)
    skip.update(id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values)
    for node in ast.walk(tree):
        if id(node) in skip or not isinstance(node, (ast.Constant, ast.JoinedStr)):
            continue
        if (said := _text(node)) is not None and " " in said.strip():
            texts.append(said)
    return regexes, texts


def _words(pattern: str) -> list[str]:
    """The literal words a regex matches (a text contract has some; a sanitiser, `[^\\w.]`, none)."""
    bare = re.sub(r"\(\?P?<[^>]*>|\(\?[:=!]|\\[A-Za-z]|\[(?:\\.|[^\]])*\]|\{[\d,]*\}", " ", pattern)
    return re.findall(r"[A-Za-z]{3,}", bare)


# regexes with words that read something other than log text
NOT_LOG_TEXT = {("profiler.py", "nccl|gloo|c10d|all_?reduce|all_?gather|reduce_?scatter|broadcast|barrier|all_to_all")}


def test_no_module_matches_another_modules_log_text():
    """What a stage hands back travels typed (components/events.py, components/summaries.py):
    no regex in pipelines/ or components/ matches a line another of their modules logs, prints
    or raises, so rewording a log line changes what people read and nothing a program does."""
    scanned = {p: _regexes_and_log_texts(p) for p in _sources("components", "pipelines")}
    assert sum(len(texts) for _, texts in scanned.values()) > 300  # the scan sees the log calls
    crossing = sorted(
        {
            f"{reader.relative_to(ROOT)}: {pattern!r} matches {writer.relative_to(ROOT)}'s {text!r}"
            for reader, (patterns, _) in scanned.items()
            for pattern in patterns
            if _words(pattern) and (reader.name, pattern) not in NOT_LOG_TEXT
            for writer, (_, texts) in scanned.items()
            if writer != reader
            for text in texts
            if re.search(pattern, text)
        }
    )
    assert not crossing, "\n".join(crossing)


def test_the_log_text_scan_finds_a_regex_on_another_modules_line(tmp_path):
    """The scan above on a contract issue 26 removed: the CLI matched the launcher's relaunch warning."""
    (tmp_path / "launcher.py").write_text('log.warning("%s failed (attempt %d of %d); relaunching: %s", a, b, c, d)\n')
    (tmp_path / "progress.py").write_text(
        'm = re.search(r"WARNING\\]?:? ?(?:[\\w.]+: )?(\\S+ failed \\(attempt .*)$", s)\n'
    )
    ((pattern,), _) = _regexes_and_log_texts(tmp_path / "progress.py")
    assert any(re.search(pattern, text) for text in _regexes_and_log_texts(tmp_path / "launcher.py")[1])


def test_every_components_work_runs_inside_its_stage_task():
    """A stage's exception reaches `liftoff run` as stage_task's `failed` event (its cause in one
    line): a component's body is its docstring, its imports, the `with stage_task(...)` block
    and a `return` of what the block made; nothing else that could raise outside it."""
    outside = []
    for path in sorted((ROOT / "components").glob("*/component.py")):
        for fn in (n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)):
            body = [s for s in fn.body if not isinstance(s, (ast.Import, ast.ImportFrom))]
            body = body[1:] if body and isinstance(body[0], ast.Expr) else body  # the docstring
            withs = [s for s in body if isinstance(s, ast.With)]
            assert len(withs) == 1, f"{path.name}:{fn.name} has no one `with stage_task`"
            for s in body:
                value = getattr(s, "value", None)
                named = isinstance(value, ast.Name) or ast.unparse(value or ast.Constant(None)).startswith("str(")
                # what the block made, returned; before it, an f-string naming the task's directory
                kept = isinstance(s, ast.Return) and named
                kept |= isinstance(s, ast.Assign) and isinstance(value, ast.JoinedStr) and s.lineno < withs[0].lineno
                if s is not withs[0] and not kept:
                    outside.append(f"{path.relative_to(ROOT)}:{s.lineno} {ast.unparse(s)[:60]}")
    assert not outside, "\n".join(outside)


def _found_outside(room: str, scan) -> list[str]:
    """`path:line` for each line `scan` finds in the code outside components/<room>/."""
    own = ROOT / "components" / room
    return [
        f"{path.relative_to(ROOT)}:{line}"
        for path in _sources("components", "pipelines", "benchmarks")
        if own not in path.parents
        for line in scan(path.read_text())
    ]


WORLD_NAMES = re.compile(r"world|procs_per_node|get_world_size")
DEGREE_NAMES = re.compile(r"\b(tp|pp|dp|dp_replicate|dp_shard|split)\b")


def _parallel_sizes(source: str) -> list[int]:
    """Lines that divide the world (or a rank) by a parallel degree: `world // (tp * pp)`,
    `nodes * procs_per_node // t.pp`, `(rank // tp) % dp`, ..."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv | ast.Div):
            left, right = ast.unparse(node.left), ast.unparse(node.right)
            if (WORLD_NAMES.search(left) or re.search(r"\brank\b", left)) and DEGREE_NAMES.search(right):
                found.append(node.lineno)
    return found


def test_only_parallel_dims_computes_a_parallel_size_or_rank():
    """Outside components/parallel/ nothing divides the world size by a degree: the trainer, the
    sampler, precision recipes, the config rules, the planner and the benchmarks ask a
    `ParallelDims` (a rule's divisibility check, `world % tp`, asks nothing of the layout)."""
    found = _found_outside("parallel", _parallel_sizes)
    assert not found, "ask components/parallel/'s ParallelDims:\n" + "\n".join(found)


def test_the_parallel_size_scan_sees_the_ways_of_dividing_the_world():
    for source in ("dp = world // (tp * pp)", "x = c.nodes * c.procs_per_node // t.dp_replicate // t.pp",
                   "r = (rank // tp) % dp", "n = dist.get_world_size() // (train.tp * train.pp)"):  # fmt: skip
        assert _parallel_sizes(source), source
    assert not _parallel_sizes("ok = world % tp == 0")


LLAMA_PATHS = re.compile(
    r"\b(self_attn|mlp|embed_tokens|lm_head|input_layernorm|post_attention_layernorm|rotary_emb|"
    r"[qkvo]_proj|gate_proj|up_proj|down_proj)\b"
)


def _module_paths(source: str) -> list[int]:
    """Lines whose code (not docstrings or comments) names a Llama module: as a string
    (`"self_attn.q_proj"`) or an attribute (`model.lm_head`, `model.model.layers`)."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if LLAMA_PATHS.search(node.value):
                found.append(node.lineno)
        elif isinstance(node, ast.Attribute) and LLAMA_PATHS.fullmatch(node.attr):
            found.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "layers" and ast.unparse(node.value).endswith("model"):
            found.append(node.lineno)
    return found


def test_only_the_model_families_name_their_module_paths():
    """Outside components/models/ no code names a Llama module: tensor parallelism, the pipeline,
    fp8, the planner, the export, validate and evaluate ask the family's `ModelSpec`."""
    found = _found_outside("models", _module_paths)
    assert not found, "ask the family's ModelSpec (components/models/):\n" + "\n".join(found)


def test_the_module_path_scan_sees_strings_and_attributes():
    for source in ('x = "self_attn.q_proj"', "w = model.lm_head.weight", "for b in model.model.layers: pass",
                   'n = name.endswith("input_layernorm")'):  # fmt: skip
        assert _module_paths(source), source
    assert not _module_paths('def f():\n    """the lm_head"""\n    return 1')


def test_the_config_rules_know_every_model_family_by_name():
    """`model.family` is checked at compose time against the families' names (the config cannot
    import components/models/, which imports it): both lists are the same."""
    from components.config.rules import FAMILY_NAMES
    from components.models import FAMILIES

    assert tuple(FAMILIES) == FAMILY_NAMES and all(spec.family == name for name, spec in FAMILIES.items())


def test_every_mutation_still_applies():
    """tests/mutations.py names each feature's one-line break: a change of the code it breaks must
    carry its mutation along (its text in its file exactly once), or the feature is unguarded."""
    from tests.mutations import MUTATIONS, ROOT

    stale = [m.name for m in MUTATIONS if (ROOT / m.path).read_text().count(m.old) != 1]
    assert not stale, stale
