"""The documentation site builds strictly, documents the API, and its
internal links resolve."""

import html
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

pytestmark = pytest.mark.tensorflow_only(
    reason="the site is built once, in the TensorFlow run (the pages' code "
    "blocks run on every backend: conftest.py)"
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def test_api_reference_documents_every_public_name(site):
    import keras_accum

    html = (site / "api" / "index.html").read_text()
    for name in keras_accum.__all__:
        assert f'id="keras_accum.{name}"' in html, name
    for member in ("from_model", "apply_partial_window", "accum_steps"):
        assert f'id="keras_accum.AccumModel.{member}"' in html, member
    # Docstring sections rendered as sections, not as raw text.
    for section in ("Parameters:", "Raises:", "Returns:"):
        assert f'doc-section-title">{section}</span>' in html, section
    assert "Micro-batches per optimizer update" in html


def test_every_page_exists_with_content(site):
    for page in [
        "index.html",
        "getting-started/index.html",
        "how-it-works/index.html",
        "guides/optimizers/index.html",
        "guides/robustness/index.html",
        "guides/distributed/index.html",
        "guides/batch-dependent-layers/index.html",
        "guides/embeddings/index.html",
        "guides/pseudo-batch-logger/index.html",
        "guides/schedules/index.html",
        "guides/auto/index.html",
        "guides/batches-that-fit/index.html",
        "guides/noise-scale/index.html",
        "guides/backends/index.html",
        "guides/fine-tuning/index.html",
        "benchmarks/index.html",
        "changelog/index.html",
    ]:
        text = (site / page).read_text()
        assert len(re.sub(r"<[^>]+>", "", text)) > 1500, page
    # Code is included from examples/, not copied, and really included.
    for page, code in [
        ("getting-started/index.html", "build(keras_accum.AccumModel"),
        ("guides/distributed/index.html", "MirroredStrategy([d.name"),
        ("guides/embeddings/index.html", "values=tf.ones((2, 2))"),
        ("guides/embeddings/index.html", "class DenseGradientModel"),
        ("guides/fine-tuning/index.html", "AccumModel.from_model(task"),
        ("guides/auto/index.html", 'accum_steps="auto"'),
        ("guides/fine-tuning/index.html", "feedforward_output_dense/kernel"),
    ]:
        text = html.unescape(re.sub(r"<[^>]+>", "", (site / page).read_text()))
        assert code in text, page
        assert "--8" not in text, page


def test_internal_links_resolve(site):
    broken = []
    for page in site.rglob("*.html"):
        text = page.read_text()
        for link in re.findall(r'(?:href|src)="([^"]+)"', text):
            parsed = urlparse(link)
            if parsed.scheme or link.startswith(("#", "mailto:", "data:")):
                continue
            path = unquote(parsed.path)
            if not path:
                continue
            if path.startswith("/"):  # The 404 page links from the root.
                target = (site / path.lstrip("/")).resolve()
            else:
                target = (page.parent / path).resolve()
            if path.endswith("/") or target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{page.relative_to(site)} -> {link}")
    assert not broken, broken


def test_the_code_map_and_benchmark_list_name_every_file():
    # The map in docs/how-it-works.md and CONTRIBUTING's list of
    # benchmark scripts, a round behind before: 13 of 22 modules, 8 of 11
    # scripts.
    code_map = (ROOT / "docs" / "how-it-works.md").read_text()
    code_map = code_map[code_map.index("## Where the code is") :]
    modules = sorted(p.name for p in (ROOT / "keras_accum").glob("*.py"))
    assert [m for m in modules if f"`{m}`" not in code_map] == []
    # Each public name, and each setting of the model's table, says where
    # it lives (the map lagged a round behind twice).
    import keras_accum
    from keras_accum import _settings

    names = [*keras_accum.__all__, *_settings.PUBLIC_NAMES]
    assert [n for n in names if f"`{n}`" not in code_map] == []
    contributing = (ROOT / "CONTRIBUTING.md").read_text()
    scripts = sorted(
        p.name
        for p in (ROOT / "benchmarks").iterdir()
        if p.suffix in (".py", ".sh")
    )
    assert [s for s in scripts if f"{s}`" not in contributing] == []


def test_no_absolute_path_of_a_machine_in_the_repository():
    tracked = subprocess.run(
        ["git", "ls-files"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    pattern = re.compile(r"/(?:work|home|root|Users|tmp)/[\w.-]+/")
    found = []
    for name in tracked:
        path = ROOT / name
        if path.suffix in (".png", ".jpg", ".whl", ".h5", ".keras", ".npz"):
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        found += [f"{name}: {m}" for m in pattern.findall(text)]
    assert found == []


def test_readme_is_a_short_front_door_to_every_guide():
    """The README is read first: at most 150 lines (it had grown to 167),
    and it links every guide."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    for page in sorted((ROOT / "docs" / "guides").glob("*.md")):
        assert f"(docs/guides/{page.name})" in text, page.name
