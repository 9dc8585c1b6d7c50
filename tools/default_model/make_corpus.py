#!/usr/bin/env python3
"""Builds the training corpus of the bundled default model from files this machine already has.

Sources (all permissive licences; see README.md in this directory):
  * the Python standard library sources of the running interpreter (PSF-2.0), including pydoc_data/topics.py
    (the English text of the language reference topics); the test suite is capped (it is large and repetitive);
  * the source code (.py) and the documentation files (.rst/.md/.txt) of an explicit allow-list of installed PyPI
    packages under MIT / BSD / Apache-2.0 / PSF / ISC licences, plus their README (the long description in the
    dist-info METADATA), each package capped at --per-package-mb.

Every document is one file. Documents are deduplicated by content, filtered (no binary-looking or minified
files, no huge data tables), and assigned to the held-out test split by a hash of their path (--test-percent).
Output (under build/, which git ignores):
  build/default_model/corpus.jsonl.gz   one JSON object per document: {"src", "licence", "path", "split", "text"}
  build/default_model/corpus_manifest.json   per-source file counts, bytes and licences
The archive is what the training machine needs (it has no network and maybe other files): carry it there.

Run: python3 tools/default_model/make_corpus.py            (about a minute; ~60-80 MB of text, ~15-20 MB gz)
     python3 tools/default_model/make_corpus.py --max-mb 2 --out build/default_model/tiny   (a small slice)
"""
import argparse
import gzip
import hashlib
import importlib.metadata as md
import io
import json
import os
import pathlib
import sys
import sysconfig

REPO = pathlib.Path(__file__).resolve().parents[2]

# PyPI distributions used, with the licence as their metadata states it (checked by hand for this list).
# Order matters only for the report. Packages not installed are skipped and reported.
PACKAGES = [
    ("transformers", "Apache-2.0"), ("torch", "BSD-3-Clause"), ("sympy", "BSD-3-Clause"),
    ("numpy", "BSD-3-Clause"), ("networkx", "BSD-3-Clause"), ("pip", "MIT"), ("Pygments", "BSD-2-Clause"),
    ("setuptools", "MIT"), ("ipython", "BSD-3-Clause"), ("mpmath", "BSD-3-Clause"), ("pydantic", "MIT"),
    ("huggingface_hub", "Apache-2.0"), ("libcst", "MIT"), ("moto", "Apache-2.0"), ("botocore", "Apache-2.0"),
    ("prompt_toolkit", "BSD-3-Clause"), ("trio", "MIT OR Apache-2.0"), ("rich", "MIT"), ("jedi", "MIT"),
    ("fsspec", "BSD-3-Clause"), ("graphql-core", "MIT"), ("Werkzeug", "BSD-3-Clause"), ("filelock", "MIT"),
    ("anyio", "MIT"), ("packaging", "Apache-2.0 OR BSD-2-Clause"), ("docker", "Apache-2.0"),
    ("Jinja2", "BSD-3-Clause"), ("pyparsing", "MIT"), ("click", "BSD-3-Clause"), ("typer", "MIT"),
    ("cryptography", "Apache-2.0 OR BSD-3-Clause"), ("urllib3", "MIT"), ("jsonschema", "MIT"),
    ("Flask", "BSD-3-Clause"), ("cffi", "MIT"), ("idna", "BSD-3-Clause"), ("boto3", "Apache-2.0"),
    ("traitlets", "BSD-3-Clause"), ("httpx", "BSD-3-Clause"), ("parso", "MIT"), ("httpcore", "BSD-3-Clause"),
    ("markdown-it-py", "MIT"), ("PyYAML", "MIT"), ("requests", "Apache-2.0"), ("attrs", "MIT"),
    ("pycparser", "BSD-3-Clause"), ("pexpect", "ISC"), ("charset-normalizer", "MIT"),
    ("typing_extensions", "PSF-2.0"), ("sortedcontainers", "Apache-2.0"), ("wrapt", "BSD-2-Clause"),
    ("h11", "MIT"), ("executing", "MIT"), ("cloudpickle", "BSD-3-Clause"), ("asttokens", "Apache-2.0"),
    ("jmespath", "MIT"), ("colorama", "BSD-3-Clause"), ("stack-data", "MIT"), ("six", "MIT"),
    ("itsdangerous", "BSD-3-Clause"), ("decorator", "BSD-2-Clause"), ("MarkupSafe", "BSD-3-Clause"),
    ("blinker", "MIT"), ("mdurl", "MIT"), ("sniffio", "MIT OR Apache-2.0"), ("tokenizers", "Apache-2.0"),
    ("safetensors", "Apache-2.0"),
]
CODE_EXT = (".py",)
DOC_EXT = (".rst", ".md", ".txt")
MAX_DOC_BYTES = 200_000  # longer files are mostly generated tables
STDLIB_TEST_CAP_MB = 6.0


def looks_like_text(t: str) -> bool:
    if not t.strip() or "\x00" in t:
        return False
    lines = t.split("\n")
    if max(len(l) for l in lines) > 2000:  # minified / data
        return False
    ctrl = sum(1 for c in t if ord(c) < 32 and c not in "\n\t\r\f")
    return ctrl < 0.001 * len(t) + 1


def read_text(p: pathlib.Path):
    try:
        b = p.read_bytes()
    except OSError:
        return None
    if len(b) > MAX_DOC_BYTES or len(b) < 64:
        return None
    try:
        t = b.decode("utf-8")
    except UnicodeDecodeError:
        return None
    t = t.replace("\r\n", "\n")
    return t if looks_like_text(t) else None


def docstrings(text: str) -> str:
    """The module, class and function docstrings of a Python file, as plain paragraphs."""
    import ast
    import inspect
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return ""
    parts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            d = ast.get_docstring(node, clean=False)
            if d and len(d) >= 80:
                d = inspect.cleandoc(d)
                title = "" if isinstance(node, ast.Module) else node.name + "\n\n"
                parts.append(title + d)
    return "\n\n".join(parts) + "\n" if parts else ""


def order_key(rel: str) -> str:
    # deterministic but spread order (so a per-package cap samples the whole package, not its first folder)
    return hashlib.sha1(rel.encode()).hexdigest()


def stdlib_files():
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root).as_posix()
        if rel.startswith(("site-packages/", "lib2to3/tests/data/")) or "__pycache__" in rel:
            continue
        out.append((rel, p))
    return root, sorted(out)


def package_files(dist):
    files = []
    for f in dist.files or []:
        s = str(f)
        if ".dist-info/" in s or ".egg-info/" in s or "__pycache__" in s or s.startswith(".."):
            continue
        if s.endswith(CODE_EXT + DOC_EXT):
            files.append((s, pathlib.Path(dist.locate_file(f))))
    return sorted(files, key=lambda x: order_key(x[0]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "build" / "default_model"), help="output directory")
    ap.add_argument("--per-package-mb", type=float, default=2.5, help="cap of text taken from one PyPI package")
    ap.add_argument("--max-mb", type=float, default=0, help="stop after this much text in all (0: no limit)")
    ap.add_argument("--test-percent", type=float, default=1.0, help="held-out share, by file")
    args = ap.parse_args()

    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    seen = set()
    docs = []  # (src, licence, path, text)
    stats = {}
    total = [0]
    limit = int(args.max_mb * 1e6) if args.max_mb > 0 else None

    def add(src, licence, path, text, cap_state=None):
        if limit is not None and total[0] >= limit:
            return False
        h = hashlib.sha1(text.encode()).digest()
        if h in seen:
            return True
        seen.add(h)
        nbytes = len(text.encode())
        docs.append((src, licence, path, text))
        s = stats.setdefault(src, {"licence": licence, "files": 0, "bytes": 0})
        s["files"] += 1
        s["bytes"] += nbytes
        total[0] += nbytes
        return True

    # 1. Python standard library (PSF-2.0). Test-suite files capped.
    root, files = stdlib_files()
    pyver = "python%d.%d" % sys.version_info[:2]
    test_bytes = 0
    for rel, p in files:
        t = read_text(p)
        if t is None:
            continue
        if rel.startswith(("test/", "idlelib/idle_test/")):
            if test_bytes > STDLIB_TEST_CAP_MB * 1e6:
                continue
            test_bytes += len(t)
        if not add("cpython-stdlib", "PSF-2.0", f"{pyver}/{rel}", t):
            break

    # 1b. English prose from the standard library: the pydoc topic texts (language reference excerpts) and, per
    # module, its docstrings as one plain-text document (these also appear inside the code documents).
    try:
        from pydoc_data.topics import topics
        for key in sorted(topics):
            add("cpython-pydoc-topics", "PSF-2.0", f"{pyver}/pydoc_data/topics/{key}", topics[key])
    except ImportError:
        pass
    for rel, p in files:
        if rel.startswith(("test/", "idlelib/idle_test/")) or "/tests/" in rel:
            continue
        t = read_text(p)
        prose = docstrings(t) if t else ""
        if len(prose) >= 400:
            add("cpython-stdlib-docstrings", "PSF-2.0", f"{pyver}/{rel}:docstrings", prose)

    # 2. PyPI packages from the allow-list.
    missing = []
    for name, licence in PACKAGES:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            missing.append(name)
            continue
        src = f"pypi:{dist.metadata['Name']}=={dist.version}"
        cap = args.per_package_mb * 1e6
        used = 0
        desc = dist.metadata.get_payload() if hasattr(dist.metadata, "get_payload") else None
        desc = desc or dist.metadata.get("Description")
        if desc and looks_like_text(desc) and len(desc) > 200:
            add(src, licence, f"{name}/README(METADATA)", desc.replace("\r\n", "\n"))
        for rel, p in package_files(dist):
            if used >= cap:
                break
            t = read_text(p)
            if t is None:
                continue
            if not add(src, licence, f"{name}/{rel}", t):
                break
            used += len(t)

    # split by path hash; a stable shuffle of documents by path hash, so that training order is mixed
    docs.sort(key=lambda d: order_key(d[2]))
    n_test = 0
    corpus_path = out_dir / "corpus.jsonl.gz"
    raw = io.BytesIO()
    with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6, mtime=0) as gz:
        for src, licence, path, text in docs:
            h = int(hashlib.sha1(("split:" + path).encode()).hexdigest()[:8], 16)
            split = "test" if (h % 10000) < args.test_percent * 100 else "train"
            n_test += split == "test"
            rec = {"src": src, "licence": licence, "path": path, "split": split, "text": text}
            gz.write((json.dumps(rec, ensure_ascii=False) + "\n").encode())
    corpus_path.write_bytes(raw.getvalue())
    manifest = {
        "documents": len(docs), "test_documents": n_test, "text_bytes": total[0],
        "archive": corpus_path.name, "archive_bytes": corpus_path.stat().st_size,
        "python": sys.version.split()[0], "missing_packages": missing, "sources": stats,
    }
    (out_dir / "corpus_manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    code = sum(len(d[3].encode()) for d in docs if d[2].endswith(".py"))
    print(f"{len(docs)} documents ({n_test} test), {total[0]/1e6:.1f} MB text ({code/1e6:.1f} MB .py), "
          f"archive {corpus_path} {corpus_path.stat().st_size/1e6:.1f} MB; missing packages: {missing or 'none'}")


if __name__ == "__main__":
    main()
