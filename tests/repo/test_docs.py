"""The documentation's code runs: every ```python block of ``docs/**/*.md``, page by page.

The blocks of a page run in order in one namespace, as a reader would paste them,
in a fresh directory, on CPU, with eight simulated CPU devices (for the sharding
page) and with warnings raised as errors. A ```text output block right after a
```python block is what that block must print (compared as doctest does, with
``...`` matching anything and whitespace normalised). A block that cannot run on
CPU or needs software mpx does not depend on (torch, Keras) is marked
```python notest; it still renders as Python.

The pages run in two subprocesses, so JAX is imported twice, not once per page:
``python tests/repo/test_docs.py docs/guide/policies.md`` runs one page and prints its result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import doctest
import io
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import textwrap
import traceback
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)
_OPEN = re.compile(r"^(?P<prefix>[ \t*+-]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_CHECKER = doctest.OutputChecker()
_OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


@dataclasses.dataclass(frozen=True)
class Block:
  """One fenced code block of a page."""

  line: int  # 1-based line of the opening fence
  lang: str
  options: tuple[str, ...]
  code: str

  @property
  def runs(self) -> bool:
    return self.lang in ("python", "py") and "notest" not in self.options

  @property
  def is_output(self) -> bool:
    return self.lang == "text" and "output" in self.options


def _closes(line: str, fence: str) -> bool:
  s = line.strip()
  return len(s) >= len(fence) and set(s) == {fence[0]}


def parse(text: str, first_line: int = 1) -> list[Block]:
  """Returns the fenced blocks of a Markdown page, those inside directives included.

  A fence may follow list markers (the cells of a MyST ``list-table``); its body is
  dedented by the width of what precedes the fence.
  """
  lines = text.splitlines()
  blocks, i = [], 0
  while i < len(lines):
    m = _OPEN.match(lines[i])
    if not m:
      i += 1
      continue
    indent, fence, info = len(m["prefix"]), m["fence"], m["info"].strip()
    j = i + 1
    while j < len(lines) and not _closes(lines[j], fence):
      j += 1
    body = "\n".join(
      line[indent:] if not line[:indent].strip() else line.lstrip() for line in lines[i + 1 : j]
    )
    if info.startswith("{"):  # a MyST directive: its content may hold code blocks
      blocks += parse(body, first_line + i + 1)
    else:
      lang, *options = info.split() or [""]
      blocks.append(Block(first_line + i, lang, tuple(options), body + "\n"))
    i = j + 1
  return blocks


def runnable(blocks: list[Block]) -> list[tuple[Block, Block | None]]:
  """The blocks to run, each with the output block that follows it, if any."""
  pairs: list[tuple[Block, Block | None]] = []
  previous = None
  for block in blocks:
    if block.is_output:
      if previous is None or not previous.runs or (pairs and pairs[-1][1] is not None):
        raise ValueError(f"line {block.line}: an output block must follow a ```python block")
      pairs[-1] = (pairs[-1][0], block)
    elif block.runs:
      pairs.append((block, None))
    previous = block
  return pairs


def run_pages(pages: list[str]) -> list[dict]:
  """Runs each page's blocks in order; returns what each printed, and the first error."""
  import jax  # noqa: F401  (imported before warnings become errors: import noise is no snippet's)
  import optax  # noqa: F401

  results = []
  for page in pages:
    path = pathlib.Path(page)
    pairs = runnable(parse(path.read_text(encoding="utf-8")))
    namespace: dict = {"__name__": "__main__"}
    printed, error = [], None
    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp), warnings.catch_warnings():
      warnings.simplefilter("error")
      for block, _ in pairs:
        out = io.StringIO()
        # Leading newlines make traceback line numbers those of the page.
        code = compile("\n" * block.line + block.code, str(path), "exec")
        try:
          with contextlib.redirect_stdout(out):
            exec(code, namespace)
        except BaseException:
          error = {"line": block.line, "traceback": traceback.format_exc()}
        printed.append(out.getvalue())
        if error:
          break
    results.append({"page": page, "printed": printed, "error": error})
  return results


def mismatches(page: pathlib.Path, result: dict) -> list[str]:
  """The output blocks of ``page`` that differ from what their code printed."""
  problems = []
  pairs = runnable(parse(page.read_text(encoding="utf-8")))
  for (block, output), printed in zip(pairs, result["printed"], strict=False):
    if output is not None and not _CHECKER.check_output(output.code, printed, _OPTIONS):
      problems.append(
        f"{page.relative_to(ROOT) if page.is_relative_to(ROOT) else page}:{block.line} printed\n"
        f"{textwrap.indent(printed, '  ')}but the page shows (line {output.line})\n"
        f"{textwrap.indent(output.code, '  ')}"
      )
  return problems


# A page that must fail: it proves that the harness reports errors and wrong outputs.
_BROKEN_PAGE = """\
```python
import mpx
print(mpx.get_policy("mixed_float16"))
```

```text output
params=float32,compute=float16,output=float16
```

```python
mpx.get_policy("mixed_fp16")
```
"""


def _code_lines(page: str) -> int:
  blocks = runnable(parse(pathlib.Path(page).read_text(encoding="utf-8")))
  return sum(block.code.count("\n") for block, _ in blocks)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
  """Runs every page once; maps each page's path to what it printed and its first error."""
  broken = tmp_path_factory.mktemp("docs") / "broken.md"
  broken.write_text(_BROKEN_PAGE, encoding="utf-8")
  pages = [str(p) for p in PAGES] + [str(broken)]
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    # Compiling dominates the run; LLVM's optimisations change how fast the snippets
    # run, not what they print, and skipping them halves the time.
    XLA_FLAGS=" ".join(
      [
        "--xla_force_host_platform_device_count=8",
        "--xla_backend_optimization_level=0",
        "--xla_cpu_use_fusion_emitters=false",  # a third less compile time (tests/conftest.py)
      ]
    ),
    PYTHONPATH=os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH")] if p),
  )
  # Two interpreters share the pages (compiling is single-threaded): on two cores this
  # halves the time; each page still runs whole, in order, in one of them. The longest
  # pages (by lines of code to run) are dealt first, each to the less loaded interpreter.
  workers = max(1, min(2, os.cpu_count() or 1))
  shares: list[list[str]] = [[] for _ in range(workers)]
  loads = [0] * workers
  for page in sorted(pages, key=_code_lines, reverse=True):
    i = loads.index(min(loads))
    shares[i].append(page)
    loads[i] += _code_lines(page)
  procs = [
    subprocess.Popen(
      [sys.executable, __file__, "--json", *share],
      cwd=ROOT,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for share in shares
  ]
  outputs = []
  try:
    outputs = [proc.communicate(timeout=600) for proc in procs]
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.communicate()
  results = []
  for proc, (out, err) in zip(procs, outputs, strict=True):
    assert proc.returncode == 0, err[-5000:]
    results += json.loads(out.splitlines()[-1])
  by_page = {r["page"]: r for r in results}
  return by_page | {"broken": by_page[str(broken)] | {"path": broken}}


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_page_runs_and_prints_what_it_shows(page, results):
  result = results[str(page)]
  if result["error"]:
    pytest.fail(
      f"{page.relative_to(ROOT)}:{result['error']['line']}\n{result['error']['traceback']}"
    )
  problems = mismatches(page, result)
  assert not problems, "\n".join(problems)


def test_a_wrong_snippet_fails(results):
  result = results["broken"]
  assert result["error"]["line"] == 10
  assert "PolicyError" in result["error"]["traceback"]
  (problem,) = mismatches(result["path"], result)
  assert "compute=float16,output=float32" in problem


def test_parse_finds_blocks_in_list_table_cells_and_directives():
  page = textwrap.dedent("""\
    ````{list-table}
    * - ```python
        a = 1
        ```
      - ```python notest
        import torch
        ```
    ````

    ```{note}
    Text.
    ```

    ```python
    print(a)
    ```

    ```text output
    1
    ```
  """)
  blocks = parse(page)
  assert [(b.line, b.lang, b.options) for b in blocks] == [
    (2, "python", ()),
    (5, "python", ("notest",)),
    (14, "python", ()),
    (18, "text", ("output",)),
  ]
  assert blocks[0].code == "a = 1\n"
  (first, none), (second, output) = runnable(blocks)
  assert (first.code, none, second.code, output.code) == ("a = 1\n", None, "print(a)\n", "1\n")


if __name__ == "__main__":
  args = sys.argv[1:]
  as_json = args[:1] == ["--json"]
  results = run_pages(args[1:] if as_json else args)
  if as_json:
    print(json.dumps(results))
  else:
    for r in results:
      problems = mismatches(pathlib.Path(r["page"]).resolve(), r)
      status = "error" if r["error"] else ("wrong output" if problems else "ok")
      print(f"{r['page']}: {len(r['printed'])} blocks run, {status}")
      if r["error"]:
        print(r["error"]["traceback"])
      print("\n".join(problems))
