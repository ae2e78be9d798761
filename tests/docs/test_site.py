"""The documentation site builds with ``mkdocs build --strict`` (no broken link, anchor or reference, no
page left out of the navigation), and its generated pages name every command, flag, config key,
environment variable and Accelerate name the code has (issue 30).

The site is built once for the module, into a temporary folder, by the same command as ``make docs``.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs._docs import ROOT, load
from tests.helpers.optional import requires

pytestmark = requires("mkdocs", "material", "mkdocstrings_handlers.python")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return out


def _text(site: Path, page: str) -> str:
    """The HTML of a page given by its Markdown path (reference/cli.md -> reference/cli/index.html)."""
    path = site / page.removesuffix(".md") / "index.html"
    if page.endswith("index.md"):
        path = site / page.removesuffix("index.md") / "index.html"
    return html.unescape(path.read_text())


def test_the_site_builds_strict_with_every_page(site: Path) -> None:
    pages = sorted(
        str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md") if "_gen" not in p.parts
    )
    pages += list(load("pages").PAGES)
    missing = [page for page in pages if "<h1" not in _text(site, page)]
    assert not missing, f"pages not built: {missing}"


def test_the_offline_search_index_covers_the_pages(site: Path) -> None:
    index = json.loads((site / "search" / "search_index.json").read_text())
    locations = {doc["location"].split("#")[0] for doc in index["docs"]}
    for page in (
        "",
        "how-to/fsdp2/",
        "reference/cli/",
        "reference/api/accelerator/",
        "migrating/api-coverage/",
    ):
        assert page in locations, f"{page!r} is not in the search index"
    assert any("resume_from_latest_checkpoint" in doc["text"] for doc in index["docs"])


def _option_names(action: argparse.Action) -> list[str]:
    return list(action.option_strings) or [action.metavar or action.dest]


def test_the_cli_page_names_every_command_and_flag(site: Path) -> None:
    text = _text(site, "reference/cli.md")
    actions = load("pages").cli_actions()
    assert len(actions) >= 13, sorted(actions)  # lockstep, its 9 commands and config's 4 actions
    missing = [path for path in actions if f"<code>{path}</code>" not in text]
    for path, command_actions in actions.items():
        section = text.split(f"<code>{path}</code>", 1)[-1]
        missing += [
            f"{path} {name}"
            for action in command_actions
            for name in _option_names(action)
            if f"<code>{name}</code>" not in section
        ]
    assert not missing, f"not on the CLI page: {missing}"


def test_the_config_page_names_every_key(site: Path) -> None:
    text = _text(site, "reference/config-file.md")
    pages = load("pages")
    from lockstep.config.file import IGNORED_KEYS

    keys = list(pages.config_top_level()) + sorted(IGNORED_KEYS)
    for keys_of_section in pages.config_sections().values():
        keys += list(keys_of_section)
    assert len(keys) > 80, len(keys)
    missing = [key for key in keys if f"<code>{key}</code>" not in text]
    assert not missing, f"config keys not on the page: {missing}"


def test_the_environment_page_names_every_variable(site: Path) -> None:
    text = _text(site, "reference/environment.md")
    pages = load("pages")
    names = list(pages.environment_variables())
    names += [name for group in pages.cluster_variables().values() for name in group]
    assert {"LOCKSTEP_HOME", "LOCKSTEP_HANG_TIMEOUT", "SLURM_PROCID", "PBS_NODEFILE"} <= set(names)
    missing = [name for name in names if f"<code>{name}</code>" not in text]
    assert not missing, f"variables not on the page: {missing}"


def test_the_coverage_page_lists_every_accelerate_name(site: Path) -> None:
    text = _text(site, "migrating/api-coverage.md")
    data = load("pages").coverage_data()
    names = [name for section in data["sections"].values() for name in section["names"]]
    assert len(names) > 400, len(names)
    missing = [name for name in names if f"<code>{name}</code>" not in text]
    assert not missing, f"Accelerate names not on the coverage page: {missing}"


def test_the_benchmark_page_shows_every_chart(site: Path) -> None:
    text = _text(site, "benchmarks/details.md")
    charts = load("pages").benchmark_images()
    assert charts
    for chart in charts:
        name = Path(chart).name
        assert (site / "benchmarks" / name).stat().st_size > 1000, name
        assert f'src="../{name}"' in text, name


def test_the_readme_is_a_short_front_door_whose_links_resolve() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 200
    for command in ("make demo", "make test", "make docs", "make docs-serve"):
        assert command in text, command
    targets = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text)
    assert len(targets) > 20, targets
    missing = [target for target in targets if not (ROOT / target).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_the_install_page_names_every_extra() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    page = (ROOT / "docs" / "getting-started" / "install.md").read_text()
    missing = [extra for extra in extras if f"`{extra}`" not in page]
    assert not missing, f"extras of pyproject.toml not on docs/getting-started/install.md: {missing}"
