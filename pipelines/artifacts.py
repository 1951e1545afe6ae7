"""`liftoff artifacts ls | show | get | rm | pin | unpin`: the store's versions for people, sizes and
dates readable; removing a version (and what names it) and keeping one from retention.

A reference on the command line is KIND/NAME[@VERSION]: VERSION may be `latest` (the default
where a changing command does not need the version itself), any unique prefix of a stored
version (`model/tiny@6aa3`), or the reference may be a run folder of `liftoff run`
(`runs/<experiment>/<date>_<time>...`), which stands for the run's model (`compare`: its
evaluation); the folder names both in its eval_report.html."""

from __future__ import annotations

import html
import json
import re
from datetime import datetime, timezone
from pathlib import Path

from components.store import KINDS, ArtifactStore, Manifest, Ref, check_part

USAGE = (
    "liftoff artifacts ls [KIND] | show KIND/NAME[@VERSION] [--json] | get KIND/NAME[@VERSION] [DEST]"
    " | rm KIND/NAME@VERSION [--with-dependants] [--force] | pin KIND/NAME@VERSION | unpin KIND/NAME@VERSION"
)
REPORT = "eval_report.html"  # what a run folder keeps of its evaluation (pipelines/summary.py keep_outputs)


class UsageError(ValueError):
    """A command line that names nothing liftoff can do; `main` prints it as one line, exit 2."""


def human_size(n: float) -> str:
    """Bytes in binary units: `512 B`, `1.5 KiB`, `3.2 MiB`."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def when(created: str) -> str:
    """A manifest's ISO time stamp as `YYYY-MM-DD HH:MM` in UTC (as stored when unreadable)."""
    try:
        stamp = datetime.fromisoformat(created)
    except (TypeError, ValueError):
        return created or "?"
    stamp = stamp.replace(tzinfo=timezone.utc) if stamp.tzinfo is None else stamp.astimezone(timezone.utc)
    return stamp.strftime("%Y-%m-%d %H:%M")


def known_kinds(store: ArtifactStore) -> list[str]:
    """The kinds the pipeline publishes and any other kind this store holds (not the store's own
    prefixes, which start with `_`: its leases)."""
    return sorted({*KINDS, *(k for k in store.backend.list_prefixes("") if not k.startswith("_"))})


def check_kind(store: ArtifactStore, kind: str) -> str:
    known = known_kinds(store)
    if kind not in known:
        raise UsageError(f"unknown artifact kind {kind!r}; the kinds are {', '.join(known)}")
    return kind


def is_directory(text: str) -> bool:
    """Whether a word of the command line names a directory; False for a word no path can be (too
    long a name, a NUL), where Path.is_dir would raise."""
    try:
        return Path(text).is_dir()
    except (OSError, ValueError):
        return False


def run_folder_refs(text: str) -> dict[str, str] | None:
    """The refs a run folder of `liftoff run` names ({"model": ..., "eval": ...}), from the header
    of the eval report it keeps; None when `text` is no run folder (a directory with `.hydra/`
    or the report). A run folder without the report (its run failed before evaluate) is an error."""
    folder = Path(text)
    if not is_directory(text) or not ((folder / ".hydra").is_dir() or (folder / REPORT).is_file()):
        return None
    if not (folder / REPORT).is_file():
        raise UsageError(f"run folder {text} holds no {REPORT}: its run did not finish (its run.log says why)")
    header = (folder / REPORT).read_text(errors="replace").split("</header>", 1)[0]
    rows = {html.unescape(k): html.unescape(v) for k, v in re.findall(r"<dt>(.*?)</dt><dd>(.*?)</dd>", header)}
    refs = {key: rows[row] for key, row in (("model", "model"), ("eval", "evaluation")) if row in rows}
    if "model" not in refs:
        raise UsageError(f"run folder {text}: its {REPORT} names no model")
    return refs


def stored_version(store: ArtifactStore, kind: str, name: str, version: str, held: bool = False) -> str:
    """The version `version` names: `latest`, itself, or the one version of kind/name it is a
    prefix of (among the valid versions; held: among every version stored, quarantined ones
    too). An ambiguous prefix is a one-line error naming the candidates; a version nothing
    matches is returned as given (the caller's lookup then says it is not there)."""
    if version == "latest":
        return version
    ref = Ref(kind, name, version)
    if store.holds(ref) if held else store.exists(ref):
        return version
    listed = store.backend.list_prefixes(f"{kind}/{name}") if held else store.backend.list_manifests(f"{kind}/{name}")
    matches = sorted(v for v in listed if v.startswith(version))
    if len(matches) > 1:
        shown = ", ".join(str(Ref(kind, name, v)) for v in matches[:8])
        more = f" and {len(matches) - 8} more" if len(matches) > 8 else ""
        raise UsageError(f"{ref} is ambiguous: {len(matches)} versions start with {version!r}: {shown}{more}")
    return matches[0] if matches else version


def parse_target(
    store: ArtifactStore, verb: str, text: str, held: bool = False, usage: str | None = None
) -> tuple[str, str, str]:
    """KIND/NAME[@VERSION] (or KIND/NAME/VERSION), VERSION a unique prefix or `latest`, or a run
    folder (its model), as (kind, name, the stored version or 'latest')."""
    if (refs := run_folder_refs(text)) is not None:
        ref = Ref.parse(refs["model"])
        return ref.kind, ref.name, ref.version
    usage = usage or f"usage: liftoff artifacts {verb} KIND/NAME[@VERSION]"
    parts = text.replace("@", "/", 1).split("/") if "@" in text else text.split("/")
    kind = check_kind(store, check_part(parts[0], "kind"))
    if len(parts) < 2 or not parts[1]:
        names = store.backend.list_prefixes(kind)
        held_names = f"the {kind} names in {store.description}: {', '.join(names)}" if names else f"no {kind} is stored"
        raise UsageError(f"{usage}: {text!r} names no artifact ({held_names})")
    if len(parts) > 3 or (len(parts) == 3 and not parts[2]):
        raise UsageError(f"{usage}: {text!r} is not an artifact reference")
    name = check_part(parts[1], "name")
    version = check_part(parts[2], "version") if len(parts) == 3 else "latest"
    return kind, name, stored_version(store, kind, name, version, held)


def total_size(m: Manifest) -> int:
    return sum(f["size"] for f in m.files.values())


def cmd_ls(store: ArtifactStore, words: list[str]) -> int:
    """One version a line, oldest first per name: ref, created (UTC), file count, total size."""
    if len(words) > 1:
        raise UsageError(f"usage: liftoff artifacts ls [KIND], got {' '.join(words)!r}")
    kind = check_kind(store, check_part(words[0], "kind")) if words else None
    rows, pins = [], {}
    for m in store.ls(kind):
        files = f"{len(m.files)} file{'' if len(m.files) == 1 else 's'}"
        if (m.ref.kind, m.ref.name) not in pins:  # one listing per name
            pins[m.ref.kind, m.ref.name] = store.pinned_versions(m.ref.kind, m.ref.name)
        pinned = "  pinned" if m.ref.version in pins[m.ref.kind, m.ref.name] else ""
        rows.append((str(m.ref), when(m.created), files, human_size(total_size(m)), pinned))
    widths = [max((len(r[i]) for r in rows), default=0) for i in range(3)]
    for row in rows:
        print(f"{row[0]:<{widths[0]}}  {row[1]}  {row[2]:>{widths[2]}}  {row[3]:>10}{row[4]}")
    return 0


def _leaves(value, key: str = ""):
    """(dotted key, one-line value) for each leaf of a metadata dict."""
    if isinstance(value, dict) and value:
        for k, v in value.items():
            yield from _leaves(v, f"{key}.{k}" if key else str(k))
    else:
        one_line = isinstance(value, str) and value.isprintable()
        yield key, value if one_line else json.dumps(value)  # a string with a newline shows it as \n


def show(store: ArtifactStore, m: Manifest) -> None:
    """A readable summary of one version: identity, metadata, files, lineage."""
    print(str(m.ref))
    print(f"  created       {when(m.created)} UTC")
    print(f"  code version  {m.code_version}")
    pin = store.pin_record(m.ref)
    if pin is None:
        print("  pinned        no")
    else:
        reason = f": {pin['reason']}" if pin.get("reason") else ""
        print(f"  pinned        since {when(pin.get('at') or '')} UTC{reason}")
    print(f"  metadata      {'' if m.metadata else '(none)'}".rstrip())
    for key, value in _leaves(m.metadata):
        print(f"    {key}: {value}")
    print(f"  files         {len(m.files)}, {human_size(total_size(m))}")
    width = max((len(rel) for rel in m.files), default=0)
    for rel, entry in sorted(m.files.items()):
        print(f"    {rel:<{width}}  {human_size(entry['size']):>10}  sha256 {entry['sha256'][:12]}")
    print("  lineage")
    _print_lineage(store.lineage(m.ref), 2)


def _print_lineage(node: dict, depth: int) -> None:
    if node.get("missing"):
        note = "  (missing from the store)"
    elif node.get("quarantined"):
        note = f"  (quarantined {when(node.get('quarantined_at') or '')} UTC: {node.get('reason')})"
    else:
        note = f"  created {when(node.get('created', ''))}  code {node.get('code_version')}"
    print("  " * depth + node["ref"] + note)
    for parent in node["parents"]:
        _print_lineage(parent, depth + 1)


def cmd_show(store: ArtifactStore, words: list[str]) -> int:
    raw = "--json" in words
    words = [w for w in words if w != "--json"]
    if len(words) != 1:
        raise UsageError("usage: liftoff artifacts show KIND/NAME[@VERSION] [--json]")
    m = store.resolve(*parse_target(store, "show", words[0]))
    if raw:
        print(m.to_json())
    else:
        show(store, m)
    return 0


def cmd_get(store: ArtifactStore, words: list[str]) -> int:
    """Download a version into DEST (default ./KIND-NAME-VERSION), every sha256 checked; print where."""
    if len(words) not in (1, 2):
        raise UsageError("usage: liftoff artifacts get KIND/NAME[@VERSION] [DEST]")
    m = store.resolve(*parse_target(store, "get", words[0]))
    dest = Path(words[1]) if len(words) == 2 else Path(f"{m.ref.kind}-{m.ref.name}-{m.ref.version}")
    if dest.exists() and not dest.is_dir():
        raise UsageError(f"get: DEST {str(dest)!r} exists and is not a directory")
    print(store.fetch(m, dest).resolve())
    return 0


def exact_ref(store: ArtifactStore, verb: str, words: list[str]) -> Ref:
    """The one KIND/NAME@VERSION a changing command names (VERSION or a unique prefix of one, among
    every version stored, quarantined ones too); `latest` is not allowed here."""
    usage = f"usage: liftoff artifacts {verb} KIND/NAME@VERSION" + (
        " [--with-dependants] [--force]" if verb == "rm" else ""
    )
    if len(words) != 1:
        raise UsageError(usage)
    kind, name, version = parse_target(store, verb, words[0], held=True)
    if version == "latest":
        raise UsageError(f"{usage}: {verb} needs the version itself, {words[0]!r} names none")
    return Ref(kind, name, version)


def cmd_rm(store: ArtifactStore, words: list[str]) -> int:
    """Remove a version: refused (one line naming them, exit 2) when some lineage names it, unless
    --with-dependants, which removes those too; refused when it or one of those dependants is
    pinned, unless --force. One line per version removed."""
    with_dependants, force = "--with-dependants" in words, "--force" in words
    ref = exact_ref(store, "rm", [w for w in words if w not in ("--with-dependants", "--force")])
    for removed in store.remove(ref, with_dependants=with_dependants, force=force):
        print(f"removed {removed}")
    return 0


def cmd_pin(store: ArtifactStore, words: list[str]) -> int:
    """Keep a version from retention."""
    ref = exact_ref(store, "pin", words)
    store.pin(ref)
    print(f"pinned {ref}")
    return 0


def cmd_unpin(store: ArtifactStore, words: list[str]) -> int:
    ref = exact_ref(store, "unpin", words)
    store.unpin(ref)
    print(f"unpinned {ref}")
    return 0


SUBCOMMANDS = {"ls": cmd_ls, "show": cmd_show, "get": cmd_get, "rm": cmd_rm, "pin": cmd_pin, "unpin": cmd_unpin}
