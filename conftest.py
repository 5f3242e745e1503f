"""The documentation's code, run as tests with Sybil.

Every ```python block of README.md and docs/**/*.md, and of the docstrings
that docs/api.md renders (keras_accum's public modules), is a pytest item
of the suite (pyproject.toml's `testpaths`), so `bash .ci/test` runs them
once per backend, after tests/:

- A page is one script: its blocks run in order in one namespace, as for
  a reader who pastes them one after another. Every name a block uses is
  defined by an earlier block of the page.
- A block that includes code (`--8<-- "examples/x.py:section"`) runs what
  the site shows: the include is expanded by pymdownx.snippets with
  mkdocs.yml's settings first.
- A block that starts with `>>>` is a doctest (ELLIPSIS and
  NORMALIZE_WHITESPACE on): its printed output is checked.
- A page marks code that runs on one backend only with Sybil's skip
  directive in an HTML comment, which the site does not show, and says so
  in its text:
  `<!-- skip: start if(BACKEND != "jax", reason="keras.distribution") -->`
  ... `<!-- skip: end -->`. `BACKEND` is the only name the tests add to
  a page (`keras.backend.backend()`).
- Each docstring example runs on its own, in a fresh namespace, after the
  setup block at the top of docs/api.md.
- Each page runs in a new temporary working directory (what it writes,
  `logs/` or `best.keras`, lands there), after `clear_session()` and seed
  0; afterwards the distribution and the dtype policy are reset.

Sybil is imported only when a documentation file is collected: the
oldest-set run (.ci/compat) collects tests/ only, without it.
"""

import doctest
import os
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
# The public modules, whose docstrings docs/api.md renders.
DOCSTRING_MODULES = ("model.py", "callbacks.py", "layers.py")
SNIPPET = "--8<--"

_collectors = {}
# Each document's working directory before it ran, and its temporary one,
# by its namespace (a docstring example clears the namespace itself).
_directories = {}


def _is_documentation(path):
    path = Path(path).resolve()
    if path == ROOT / "README.md":
        return True
    if path.suffix == ".md" and ROOT / "docs" in path.parents:
        return True
    return path.parent == ROOT / "keras_accum" and path.name in (
        DOCSTRING_MODULES
    )


def _requested(config, path):
    """Whether `path` is one of the run's paths (given, or `testpaths`)
    or lies under one. pytest also offers the files beside the path
    of a run like `pytest tests/test_model.py` (README.md)."""
    path = Path(path).resolve()
    for arg in config.args:
        target = (config.invocation_params.dir / arg.split("::")[0]).resolve()
        if path == target or target in path.parents:
            return True
    return False


def pytest_collect_file(file_path, parent):
    if not _is_documentation(file_path):
        return None
    if not _requested(parent.config, file_path):
        return None
    kind = "docstrings" if file_path.suffix == ".py" else "pages"
    if kind not in _collectors:
        _collectors[kind] = _sybil(kind).pytest()
    return _collectors[kind](file_path, parent)


def _sybil(kind):
    from sybil import Sybil
    from sybil.parsers.markdown import (
        CodeBlockParser,
        PythonCodeBlockParser,
        SkipParser,
    )

    class Parser(PythonCodeBlockParser):
        """```python blocks (doctests when they start with `>>>`), run
        by `evaluate`."""

        def __init__(self, evaluate):
            super().__init__(
                doctest_optionflags=doctest.ELLIPSIS
                | doctest.NORMALIZE_WHITESPACE
            )
            self.codeblock_parser = CodeBlockParser("python", evaluate)

    if kind == "pages":
        return Sybil(
            parsers=[Parser(_run_page_block), SkipParser()],
            patterns=["README.md", "docs/*.md", "docs/*/*.md"],
            path=str(ROOT),
            setup=_start_document,
            teardown=_end_document,
        )
    return Sybil(
        parsers=[Parser(_run_docstring_example), SkipParser()],
        patterns=[f"keras_accum/{name}" for name in DOCSTRING_MODULES],
        path=str(ROOT),
        setup=_start_document,
        teardown=_end_document,
    )


def _execute(source, path, namespace, first_line=0):
    # Padded so that a traceback names the block's line in the page.
    code = compile("\n" * first_line + source, path, "exec", dont_inherit=True)
    exec(code, namespace)
    namespace.pop("__builtins__", None)


def _expand_snippets(source):
    """The block as the site shows it: includes expanded by the same
    extension and settings as mkdocs.yml's."""
    import markdown
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    settings = next(
        entry["pymdownx.snippets"]
        for entry in config["markdown_extensions"]
        if isinstance(entry, dict) and "pymdownx.snippets" in entry
    )
    settings = {**settings, "base_path": [str(ROOT)]}
    md = markdown.Markdown(
        extensions=["pymdownx.snippets"],
        extension_configs={"pymdownx.snippets": settings},
    )
    lines = md.preprocessors["snippet"].run(source.splitlines())
    return "\n".join(lines) + "\n"


def _run_page_block(example):
    source = str(example.parsed)
    if SNIPPET in source:
        _execute(_expand_snippets(source), example.path, example.namespace)
    else:
        first_line = example.line + example.parsed.line_offset
        _execute(source, example.path, example.namespace, first_line)


def _api_setup():
    """The first ```python block of docs/api.md: what the docstring
    examples there may use."""
    from sybil import Document
    from sybil.parsers.markdown.lexers import FencedCodeBlockLexer

    path = ROOT / "docs" / "api.md"
    document = Document(path.read_text(), str(path))
    region = next(iter(FencedCodeBlockLexer("python")(document)))
    return str(region.lexemes["source"])


def _run_docstring_example(example):
    import keras

    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    example.namespace.clear()
    example.namespace["BACKEND"] = keras.backend.backend()
    _execute(_api_setup(), "docs/api.md", example.namespace)
    first_line = example.line + example.parsed.line_offset
    _execute(str(example.parsed), example.path, example.namespace, first_line)


def _start_document(namespace):
    import keras

    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    namespace["BACKEND"] = keras.backend.backend()
    directory = tempfile.TemporaryDirectory(prefix="keras-accum-docs-")
    _directories[id(namespace)] = (os.getcwd(), directory)
    os.chdir(directory.name)


def _end_document(namespace):
    import keras

    cwd, directory = _directories.pop(id(namespace))
    os.chdir(cwd)
    directory.cleanup()
    keras.distribution.set_distribution(None)
    keras.config.set_dtype_policy("float32")
    keras.backend.clear_session()
