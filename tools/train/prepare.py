"""Writes the training corpus of the built-in model and trains its tokenizer, deterministically.

    python3 tools/train/prepare.py --out /tmp/phloem-corpus            # corpus + tokenizer
    python3 tools/train/prepare.py --out DIR --stdlib-bytes 200000     # a smaller corpus

The corpus is made here, from material anyone may redistribute:

* **Python standard-library source** (PSF licence) read from the running interpreter's stdlib
  folder: a fixed list of modules in a fixed order, each file cut at ``PER_FILE_BYTES``, the whole
  cut at ``--stdlib-bytes``; plus the module docstrings of a longer fixed list, as prose. (Another
  Python version has other sources, hence another corpus: the model card names the version.)
* **Synthetic agent transcripts** rendered with the model's own ChatML template
  (``runtime._default_model_tokenizer.CHAT_TEMPLATE``, through transformers' renderer, as the
  server renders requests): a user asks, the assistant writes ``<tool_call>`` JSON for one of a
  handful of tools (calculator, weather, key/value store, a coding workspace's
  ``list_files``/``read_file``/``run_tests`` as in ``docs/examples/agent.py``), the tool's result
  comes back as ``<tool_response>``, the assistant answers, and follow-up turns repeat it.
  Everything is drawn from ``random.Random(seed)``.

Documents are separated by ``<|endoftext|>``. Every 20th document (by its index) is held out.
Outputs in ``--out``: ``train.txt``, ``heldout.txt`` (documents joined by ``<|endoftext|>``),
``tokenizer.json`` (byte-level BPE trained on ``train.txt``), ``manifest.json`` (sizes, sha256).
Same arguments, same interpreter: the same bytes.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import random
import sys
import sysconfig
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from phloem.runtime._default_model_tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS

EOT = "<|endoftext|>"
HELDOUT_EVERY = 20
PER_FILE_BYTES = 24_000
DEFAULT_STDLIB_BYTES = 700_000
DEFAULT_TRANSCRIPTS = 2400
DEFAULT_VOCAB = 4096
SEED = 34

# Read in this order; a name missing from this interpreter is skipped.
STDLIB_FILES = (
    "textwrap.py", "string.py", "bisect.py", "heapq.py", "fnmatch.py", "glob.py", "shlex.py",
    "json/__init__.py", "json/decoder.py", "json/encoder.py", "copy.py", "keyword.py",
    "colorsys.py", "queue.py", "fractions.py", "statistics.py", "random.py", "functools.py",
    "collections/__init__.py", "dataclasses.py", "enum.py", "abc.py", "contextlib.py",
    "operator.py", "numbers.py", "calendar.py", "datetime.py", "difflib.py", "csv.py",
    "configparser.py", "argparse.py", "shutil.py", "pathlib.py", "tempfile.py", "base64.py",
    "hashlib.py", "hmac.py", "uuid.py", "ipaddress.py", "pprint.py", "reprlib.py", "graphlib.py",
    "sched.py", "selectors.py", "socketserver.py", "html/__init__.py", "html/parser.py",
    "urllib/parse.py", "http/__init__.py", "email/utils.py", "logging/__init__.py", "gettext.py",
    "locale.py", "weakref.py", "types.py", "typing.py", "inspect.py", "ast.py", "tokenize.py",
    "dis.py", "traceback.py", "warnings.py", "linecache.py", "zipfile.py", "tarfile.py",
    "gzip.py", "bz2.py", "lzma.py", "subprocess.py", "threading.py", "os.py", "posixpath.py",
)
# Module docstrings only (prose), beside the sources above.
DOCSTRING_FILES = STDLIB_FILES + (
    "asyncio/__init__.py", "asyncio/events.py", "asyncio/tasks.py", "asyncio/queues.py",
    "concurrent/futures/_base.py", "sqlite3/__init__.py", "unittest/case.py", "doctest.py",
    "pdb.py", "cmd.py", "code.py", "timeit.py", "trace.py", "profile.py", "pstats.py",
    "secrets.py", "smtplib.py", "ftplib.py", "imaplib.py", "poplib.py", "mailbox.py",
    "mimetypes.py", "quopri.py", "plistlib.py", "netrc.py", "filecmp.py", "fileinput.py",
    "stat.py", "codecs.py", "io.py", "struct.py", "signal.py", "platform.py", "sysconfig.py",
    "site.py", "zipapp.py", "runpy.py", "pkgutil.py", "modulefinder.py", "compileall.py",
    "py_compile.py", "tabnanny.py", "pyclbr.py", "symtable.py", "opcode.py", "token.py",
    "webbrowser.py", "wave.py", "chunk.py", "sndhdr.py", "imghdr.py", "turtle.py",
)


# --- standard library --------------------------------------------------------------------------


def stdlib_documents(max_bytes: int) -> list[str]:
    """Module docstrings (one document of prose, at most a quarter of ``max_bytes``), then sources
    in list order, up to ``max_bytes`` in all (not counting each source's ``# file:`` line)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    prose = []
    for name in DOCSTRING_FILES:
        path = root / name
        if not path.is_file():
            continue
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError):
            continue
        if doc:
            prose.append(f"Module {name.removesuffix('.py').replace('/', '.')}:\n{doc.strip()}\n")
    text = "\n".join(prose)
    if len(text) > max_bytes // 4:  # the prose takes at most a quarter of the budget
        text = text[: text.rfind("\n", 0, max_bytes // 4) + 1]
    docs = [text] if text else []
    used = len(text)
    for name in STDLIB_FILES:
        path = root / name
        if not path.is_file() or used >= max_bytes:
            continue
        text = path.read_text(encoding="utf-8")[: min(PER_FILE_BYTES, max_bytes - used)]
        # Cut at a line end so no document ends mid-token of a line.
        text = text[: text.rfind("\n") + 1] if "\n" in text else text
        docs.append(f"# file: Lib/{name}\n{text}")
        used += len(docs[-1])
    return docs


# --- synthetic agent transcripts ---------------------------------------------------------------


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str] | None = None) -> dict:
    params: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        params["required"] = required
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


CALCULATOR = _tool("calculator", "Evaluate an arithmetic expression",
                   {"expression": {"type": "string"}}, ["expression"])
WEATHER = _tool("get_weather", "Current weather of a city", {"city": {"type": "string"}}, ["city"])
KV_GET = _tool("kv_get", "Read a value from the key/value store", {"key": {"type": "string"}}, ["key"])
KV_SET = _tool("kv_set", "Store a value under a key",
               {"key": {"type": "string"}, "value": {"type": "string"}}, ["key", "value"])
# The coding tools exactly as docs/examples/agent.py declares them.
LIST_FILES = {"type": "function", "function": {"name": "list_files", "description": "List the workspace files",
                                               "parameters": {"type": "object", "properties": {}}}}
READ_FILE = {"type": "function", "function": {"name": "read_file", "description": "Read one file",
                                              "parameters": {"type": "object",
                                                             "properties": {"path": {"type": "string"}}}}}
RUN_TESTS = {"type": "function", "function": {"name": "run_tests", "description": "Run the tests with a patch",
                                              "parameters": {"type": "object",
                                                             "properties": {"fix": {"type": "string"}}}}}

CITIES = ("Paris", "Oslo", "Lima", "Tokyo", "Cairo", "Berlin", "Madrid", "Nairobi", "Sydney", "Toronto",
          "Mumbai", "Dublin", "Quito", "Seoul", "Rome", "Lisbon", "Vienna", "Austin", "Denver", "Hanoi")
CONDITIONS = ("sunny", "cloudy", "rain", "snow", "fog", "windy", "clear", "storms")
KEYS = ("username", "theme", "language", "timezone", "project", "owner", "version", "region", "color",
        "editor", "shell", "branch", "deadline", "budget", "status")
VALUES = ("alice", "dark", "english", "UTC", "phloem", "bob", "1.4.2", "eu-west", "green", "vim",
          "bash", "main", "friday", "1200", "done", "light", "carol", "us-east", "blue", "emacs")
SYSTEMS = (
    "You are a helpful assistant. Use the tools when they help.",
    "You are a careful assistant. Call a tool when you need a fact, then answer briefly.",
    "You are a careful coding agent. Use the tools, read their results, then answer.",
    "",
)
NAMES = ("mean", "total", "average", "largest", "smallest", "count_words", "double", "square", "clamp",
         "first", "last", "is_even", "halve", "area", "perimeter")


def _calc_expr(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice("+-*/")
    if op == "/":
        a = a * b
    expr = f"{a} {op} {b}"
    if rng.random() < 0.3:
        c = rng.randint(2, 20)
        expr = f"({expr}) * {c}" if op != "/" else f"{expr} + {c}"
    value = eval(expr, {"__builtins__": {}})  # our own generated arithmetic
    value = int(value) if float(value).is_integer() else round(value, 4)
    return expr, str(value)


def _call(name: str, arguments: dict[str, Any], content: str = "") -> dict[str, Any]:
    return {"role": "assistant", "content": content,
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}


def _calculator_chat(rng: random.Random) -> tuple[list[dict], list[dict]]:
    msgs: list[dict] = []
    expr, value = _calc_expr(rng)
    ask = rng.choice(("What is {e}?", "Compute {e}.", "Please calculate {e}", "How much is {e}?",
                      "Use the calculator: {e}", "I need {e}, quickly."))
    msgs += [{"role": "user", "content": ask.format(e=expr)},
             _call("calculator", {"expression": expr}, rng.choice(("", "", "Let me compute that."))),
             {"role": "tool", "content": value},
             {"role": "assistant", "content": rng.choice(("{e} = {v}.", "The answer is {v}.", "It is {v}."))
              .format(e=expr, v=value)}]
    if rng.random() < 0.5:
        b = rng.randint(2, 50)
        op = rng.choice(("add", "subtract", "multiply it by"))
        sym = {"add": "+", "subtract": "-", "multiply it by": "*"}[op]
        expr2 = f"{value} {sym} {b}"
        value2 = eval(expr2, {"__builtins__": {}})
        value2 = int(value2) if float(value2).is_integer() else round(value2, 4)
        msgs += [{"role": "user", "content": f"Now {op} {b}."},
                 _call("calculator", {"expression": expr2}),
                 {"role": "tool", "content": str(value2)},
                 {"role": "assistant", "content": f"{expr2} = {value2}."}]
    return msgs, [CALCULATOR]


def _weather_report(rng: random.Random, city: str) -> tuple[str, int, str]:
    temp, cond = rng.randint(-15, 38), rng.choice(CONDITIONS)
    return json.dumps({"city": city, "temperature_c": temp, "conditions": cond}), temp, cond


def _weather_chat(rng: random.Random) -> tuple[list[dict], list[dict]]:
    city = rng.choice(CITIES)
    result, temp, cond = _weather_report(rng, city)
    ask = rng.choice(("What is the weather in {c}?", "Is it cold in {c} right now?", "Weather for {c}, please.",
                      "Should I take an umbrella in {c} today?", "How warm is it in {c}?"))
    msgs = [{"role": "user", "content": ask.format(c=city)},
            _call("get_weather", {"city": city}),
            {"role": "tool", "content": result},
            {"role": "assistant", "content": f"In {city} it is {temp} degrees C, {cond}."}]
    if rng.random() < 0.5:
        other = rng.choice([c for c in CITIES if c != city])
        result2, temp2, cond2 = _weather_report(rng, other)
        warmer = city if temp > temp2 else other
        msgs += [{"role": "user", "content": rng.choice(("And in {c}?", "Compare with {c}.", "What about {c}?"))
                  .format(c=other)},
                 _call("get_weather", {"city": other}),
                 {"role": "tool", "content": result2},
                 {"role": "assistant", "content": f"In {other} it is {temp2} degrees C, {cond2}; {warmer} is warmer."}]
    return msgs, [WEATHER, CALCULATOR] if rng.random() < 0.3 else [WEATHER]


def _kv_chat(rng: random.Random) -> tuple[list[dict], list[dict]]:
    key, value = rng.choice(KEYS), rng.choice(VALUES)
    msgs: list[dict] = []
    if rng.random() < 0.5:
        msgs += [{"role": "user", "content": rng.choice(("Remember that my {k} is {v}.", "Set {k} to {v}.",
                                                          "Store {v} as the {k}."))
                  .format(k=key, v=value)},
                 _call("kv_set", {"key": key, "value": value}),
                 {"role": "tool", "content": "ok"},
                 {"role": "assistant", "content": f"Saved: {key} = {value}."}]
        ask = rng.choice(("What is my {k}?", "Read back the {k}.", "Which {k} did I set?"))
        msgs += [{"role": "user", "content": ask.format(k=key)},
                 _call("kv_get", {"key": key}),
                 {"role": "tool", "content": value},
                 {"role": "assistant", "content": f"Your {key} is {value}."}]
    else:
        stored = rng.random() < 0.8
        msgs += [{"role": "user", "content": rng.choice(("What is the {k}?", "Look up {k} in the store.",
                                                          "Do we have a {k} saved?")).format(k=key)},
                 _call("kv_get", {"key": key}),
                 {"role": "tool", "content": value if stored else "error: no such key"},
                 {"role": "assistant", "content": f"The {key} is {value}." if stored
                  else f"There is no {key} in the store."}]
    return msgs, [KV_GET, KV_SET]


def _workspace(rng: random.Random) -> tuple[dict[str, str], str, str, str]:
    """A one-bug workspace: files, the module name, the buggy line, the fixed line."""
    name = rng.choice(NAMES)
    module = rng.choice(("stats", "mathutil", "helpers", "calc", "shapes", "text"))
    cases = {
        "mean": ("xs", "sum(xs) / (len(xs) - 1)", "sum(xs) / len(xs)", "[1, 2, 3]", "2"),
        "average": ("xs", "sum(xs) / (len(xs) + 1)", "sum(xs) / len(xs)", "[2, 4, 6]", "4"),
        "total": ("xs", "sum(xs) - 1", "sum(xs)", "[1, 2, 3]", "6"),
        "largest": ("xs", "min(xs)", "max(xs)", "[3, 9, 4]", "9"),
        "smallest": ("xs", "max(xs)", "min(xs)", "[3, 9, 4]", "3"),
        "count_words": ("s", "len(s.split(' ')) - 1", "len(s.split())", "'a b c'", "3"),
        "double": ("x", "x + 2", "x * 2", "5", "10"),
        "square": ("x", "x * 2", "x * x", "3", "9"),
        "clamp": ("x", "max(0, min(x, 9))", "max(0, min(x, 10))", "12", "10"),
        "first": ("xs", "xs[1]", "xs[0]", "[7, 8, 9]", "7"),
        "last": ("xs", "xs[0]", "xs[-1]", "[7, 8, 9]", "9"),
        "is_even": ("n", "n % 2 == 1", "n % 2 == 0", "4", "True"),
        "halve": ("x", "x // 3", "x // 2", "10", "5"),
        "area": ("w, h", "w + h", "w * h", "3, 4", "12"),
        "perimeter": ("w, h", "w * h * 2", "2 * (w + h)", "3, 4", "14"),
    }
    arg, bug, fix, call_args, expected = cases[name]
    buggy_line, fixed_line = f"    return {bug}", f"    return {fix}"
    files = {
        f"{module}.py": f"def {name}({arg}):\n{buggy_line}\n",
        f"test_{module}.py": (f"from {module} import {name}\n\n\ndef test_{name}():\n"
                              f"    assert {name}({call_args}) == {expected}\n"),
    }
    if rng.random() < 0.5:
        files["README.md"] = f"# {module}\n\nSmall helpers. Run the tests with pytest.\n"
    return files, module, buggy_line, fixed_line


def _coding_chat(rng: random.Random) -> tuple[list[dict], list[dict]]:
    files, module, buggy, fixed = _workspace(rng)
    test_file = f"test_{module}.py"
    task = rng.choice(("The test in {t} fails. Find out why and fix {m}.py.",
                       "{t} is failing. Please find the bug in {m}.py.",
                       "Fix the failing test in this workspace."))
    msgs: list[dict] = [{"role": "user", "content": task.format(t=test_file, m=module)}]
    msgs += [_call("list_files", {}, rng.choice(("", "", "First I look at the workspace."))),
             {"role": "tool", "content": "\n".join(sorted(files))}]
    for path in (test_file, f"{module}.py") if rng.random() < 0.5 else (f"{module}.py",):
        msgs += [_call("read_file", {"path": path}), {"role": "tool", "content": files[path]}]
    msgs += [_call("run_tests", {"fix": fixed}, f"The line `{buggy.strip()}` is wrong. I try `{fixed.strip()}`."),
             {"role": "tool", "content": "1 passed"},
             {"role": "assistant", "content": f"Fixed: in {module}.py, `{buggy.strip()}` becomes "
                                              f"`{fixed.strip()}`, and the test passes."}]
    if rng.random() < 0.3:
        msgs += [{"role": "user", "content": f"Try this fix:\n{buggy}\nThen run the tests."},
                 _call("run_tests", {"fix": buggy}),
                 {"role": "tool", "content": "FAILED"},
                 {"role": "assistant", "content": "That fix fails: the test does not pass with the original line."}]
    return msgs, [LIST_FILES, READ_FILE, RUN_TESTS]


def _plain_chat(rng: random.Random) -> tuple[list[dict], list[dict]]:
    pairs = (
        ("Hello!", "Hello! How can I help you today?"),
        ("Who are you?", "I am a small language model trained by Phloem to call tools and answer briefly."),
        ("What tools can you use?", "I can use the tools listed in the system message, such as a calculator."),
        ("Say something short.", "Something short."),
        ("Thanks!", "You are welcome."),
        ("What is a session?", "A session is one conversation kept on the server, turn after turn."),
        ("What does a tool call look like?", "I write the function name and its JSON arguments in a tool call."),
        ("Write a Python function that adds two numbers.", "def add(a, b):\n    return a + b"),
        ("How do I read a file in Python?", "with open(path) as f:\n    text = f.read()"),
        ("What is the capital of France?", "Paris."),
    )
    user, answer = rng.choice(pairs)
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}], []


SCENARIOS = ((_calculator_chat, 3), (_weather_chat, 3), (_kv_chat, 2), (_coding_chat, 4), (_plain_chat, 1))


def render(messages: list[dict], tools: list[dict]) -> str:
    """The chat as the server's template renders it (transformers' Jinja environment)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], tools=tools or None,
                                        chat_template=CHAT_TEMPLATE, add_generation_prompt=False)
    return rendered[0]


def transcript_documents(count: int, seed: int = SEED) -> list[str]:
    rng = random.Random(seed)
    makers = [m for m, weight in SCENARIOS for _ in range(weight)]
    docs = []
    for _ in range(count):
        messages, tools = rng.choice(makers)(rng)
        system = rng.choice(SYSTEMS)
        if system:
            messages = [{"role": "system", "content": system}, *messages]
        docs.append(render(messages, tools))
    return docs


# --- corpus, split, tokenizer ------------------------------------------------------------------


def build_documents(stdlib_bytes: int, transcripts: int, seed: int = SEED) -> list[str]:
    """Standard-library documents and transcripts interleaved in a seeded order."""
    docs = stdlib_documents(stdlib_bytes) + transcript_documents(transcripts, seed)
    random.Random(seed + 1).shuffle(docs)
    return docs


def split(docs: list[str]) -> tuple[list[str], list[str]]:
    held = [d for i, d in enumerate(docs) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    train = [d for i, d in enumerate(docs) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    return train, held


def train_tokenizer(text: str, vocab_size: int) -> Tokenizer:
    """Byte-level BPE as the random demo model's (``runtime._default_model_tokenizer``), on ``text``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    # Special tokens must not be merged into: train on the text between them.
    tokenizer.train_from_iterator((part for doc in text.split(EOT) for part in doc.splitlines(keepends=True)),
                                  trainer=trainer)
    return tokenizer


def prepare(out: Path, stdlib_bytes: int = DEFAULT_STDLIB_BYTES, transcripts: int = DEFAULT_TRANSCRIPTS,
            vocab_size: int = DEFAULT_VOCAB, seed: int = SEED, tokenizer: bool = True) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    train, held = split(build_documents(stdlib_bytes, transcripts, seed))
    files = {"train.txt": EOT.join(train) + EOT, "heldout.txt": EOT.join(held) + EOT}
    manifest: dict[str, Any] = {
        "python": sys.version.split()[0], "seed": seed, "stdlib_bytes": stdlib_bytes,
        "transcripts": transcripts, "documents": {"train": len(train), "heldout": len(held)},
    }
    for name, text in files.items():
        data = text.encode("utf-8")
        (out / name).write_bytes(data)
        manifest[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if tokenizer:
        tok = train_tokenizer(files["train.txt"], vocab_size)
        tok.save(str(out / "tokenizer.json"))
        manifest["vocab_size"] = tok.get_vocab_size()
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the corpus and tokenizer")
    parser.add_argument("--stdlib-bytes", type=int, default=DEFAULT_STDLIB_BYTES)
    parser.add_argument("--transcripts", type=int, default=DEFAULT_TRANSCRIPTS)
    parser.add_argument("--vocab", type=int, default=DEFAULT_VOCAB, help="BPE vocabulary size")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    manifest = prepare(args.out, args.stdlib_bytes, args.transcripts, args.vocab, args.seed)
    print(json.dumps(manifest, indent=2))


if __name__ == "__main__":
    main()
