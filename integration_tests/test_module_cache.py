"""The module cache's KV connector (``KVReuseModuleCache``) in the real CPU engine, on the small model.

One engine for the module: the connector on as a plain splice (``modules.recompute_first`` 0), kvreuse's attention
backend in place of CPU_ATTN (``KVREUSE_SPARSE_CPU_BACKEND=1``, ``beta = inf``: dense attention by CPU_ATTN's own
op on its own layout, equal to the stock engine's, see ``test_sparse_backend.py``; the connector reads the op's
tiles through the backend's plain views), float32. "Connector off" for a request is
vLLM's own ``skip_reading_prefix_cache``, which makes the scheduler ignore the connector and compute the whole
prompt. The prefix cache is reset before a prompt whose modules must come from the connector rather than from
vLLM's own prefix hits.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from greedy import LOGPROBS, assert_same_greedy_path
from real_engine import module_cache_llm

pytestmark = pytest.mark.engine

TEXTS = {
    "I": "You translate questions about movies into SQL. Answer with one query and nothing else.",
    "A": "Table movies has columns title, year, genre and rating; rating is out of ten.",
    "B": "Table reviews has columns title, critic, score and text; title refers to movies.",
    "C": "Table people has columns name, born, role and title; role is actor or director.",
}
QUESTION = "Question: which drama from 1994 has the best rating?\nSQL:"
MAX_TOKENS = 8
TOP = 20  # log-probabilities compared per first generated token (vLLM's default max_logprobs)


def _call(fn, *args):
    """A closure for ``collective_rpc`` that runs ``fn(module_worker(), *args)`` in the worker."""

    def call(worker):
        from kvreuse.vllm.runtime import module_worker

        return fn(module_worker(), *args)

    return call


def _figures(worker):
    from kvreuse.vllm.runtime import module_figures

    return module_figures()


def figures(llm) -> dict:
    return llm.collective_rpc(_call(_figures))[0]


@pytest.fixture(scope="module")
def llm(small_model):
    # The plain splice (recompute_first 0, not the default 16): these tests check the spliced KV against the module
    # encoded at that position and count the tokens loaded (test_module_splice_quality.py covers the recompute).
    with module_cache_llm(small_model, cpu_bytes=64 << 20, recompute_first=0) as engine:
        yield engine


@pytest.fixture(scope="module")
def modules(llm):
    from kvreuse.vllm.modules import encode_modules

    return encode_modules(llm, TEXTS)


@pytest.fixture(scope="module")
def question(llm):
    return llm.get_tokenizer().encode(QUESTION, add_special_tokens=False)


def _exact_attention(worker):
    """(whether the sparse backend runs vLLM's CPU op, whether kvreuse reads that op's key tiles on this CPU)."""
    import torch

    from kvreuse.vllm.runtime import sparse_attention
    from kvreuse.vllm.sparse.cpu_kernel import CPUAttentionKernel

    attention = sparse_attention()
    op = CPUAttentionKernel(torch.float32, attention.block_size, attention.head_dim, attention.scale)
    return attention.paged_kernel is not None, op.knows_key_tiles


def test_beside_the_connector_the_backend_runs_vllms_cpu_op_where_kvreuse_reads_its_tiles(llm):
    """Every step that splices no module with recompute or APE runs vLLM's own CPU attention op, whose tiles the
    connector reads through plain views; kvreuse's own PyTorch attention (1.4-2x stock's decode time at 4K-8K)
    only on a CPU whose key tiles kvreuse does not read."""
    runs_op, knows_tiles = llm.collective_rpc(_exact_attention)[0]
    assert runs_op == knows_tiles


def generate(llm, prompts, *, recompute=False, logprobs=None):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=logprobs, skip_reading_prefix_cache=recompute
    )
    return llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)


def test_encode_requests_put_each_module_in_the_store(llm, modules):
    got = figures(llm)
    assert got["modules_encoded"] == len(TEXTS) and got["modules"] == len(TEXTS)
    assert got["encode_failures"] == 0
    assert set(got["used_bytes"]) == {"cpu"} and got["used_bytes"]["cpu"] > 0


def _spliced_and_encoded_keys(worker, reference_name, spliced_name, length, layers):
    """Keys of the spliced piece read from the paged cache, and the reference module's keys, per layer."""
    request, piece, slots = next(load for load in worker.last_loads if load[1].name.name == spliced_name)
    reference = next(key for key in worker.store._where if key.name == reference_name)
    module = worker.store.get(reference)
    out = []
    for layer in layers:
        name = worker.layers[layer]
        keys, _ = worker.kv_of(name, worker.vllm_config.compilation_config.static_forward_context[name].kv_cache)
        slot = torch.tensor(slots)
        spliced = keys[slot // keys.shape[1], slot % keys.shape[1]]
        out.append((spliced.tolist(), module.keys(layer)[:length].tolist(), piece.prompt_start, module.start))
    return out  # lists: collective_rpc returns plain values


def test_a_module_spliced_at_position_p_has_the_layer0_keys_of_encoding_it_at_p(llm, modules, question):
    from kvreuse.vllm.modules import encode_modules

    # Reference: module A's tokens and one more, encoded after module I, so its keys sit at p = len(I). Layer 0
    # keys depend only on the token and its position, so they must equal A's keys moved from 0 to p.
    extra = [t for t in question if t != question[0]][:1]
    encode_modules(llm, {"A@p": modules["A"] + extra}, contexts={"A@p": modules["I"]})
    llm.reset_prefix_cache()
    generate(llm, [modules["I"] + modules["A"] + question])
    layers = [0, 1]
    ((layer0, layer1),) = llm.collective_rpc(_call(_spliced_and_encoded_keys, "A@p", "A", len(modules["A"]), layers))
    spliced, encoded, at, start = layer0
    spliced, encoded = torch.tensor(spliced), torch.tensor(encoded)
    assert at == start == len(modules["I"]) and spliced.shape == encoded.shape
    # fp32: the engine rotates with an fp32 cos/sin cache, the splice in float64 then rounds once. Apart by at most
    # two rounded rotations (tests/numerics.py, rotation_bound: 2 x 1.5 x (gamma_3 + u) x 2 max|k| ~ 4e-6 max|k|) and
    # the engine's fp32 angles at p < 100 (p x inv_freq rounded twice: 2 u p ~ 1.2e-5 rad, so 1.2e-5 max|k|):
    # 1e-4 max|k| is a few times their sum and far below what a wrong position moves a key (~ its size).
    scale = encoded.abs().max().item()
    assert at < 100 and (spliced - encoded).abs().max().item() <= 1e-4 * scale
    # Layer 1 differs by design: spliced, A attended only to itself; the reference attended to I as well.
    spliced1, encoded1 = torch.tensor(layer1[0]), torch.tensor(layer1[1])
    assert (spliced1 - encoded1).abs().max().item() > 1e-3 * encoded1.abs().max().item()


def test_one_module_at_position_0_gives_the_greedy_tokens_of_recomputing(llm, modules, question):
    """Recomputing is the reference. The module's KV were computed in a prefill of the module alone, the
    recomputation's in one of the whole prompt: other matrix shapes, so other summation orders, the same math at
    position 0. Same tokens at every decided step, log-probabilities within rounding (``greedy.py``)."""
    llm.reset_prefix_cache()
    before = figures(llm)["tokens_loaded"]
    prompt = modules["A"] + question
    spliced = generate(llm, [prompt], logprobs=LOGPROBS)[0]
    assert figures(llm)["tokens_loaded"] - before == len(modules["A"])
    assert spliced.num_cached_tokens == len(modules["A"])
    recomputed = generate(llm, [prompt], recompute=True, logprobs=LOGPROBS)[0]
    assert recomputed.num_cached_tokens == 0
    assert_same_greedy_path(recomputed.outputs[0], spliced.outputs[0], "module A at position 0")


def test_modules_in_varying_order_are_served_from_the_cache_and_compared_with_recomputing(llm, modules, question):
    orders = list(itertools.permutations("ABC"))
    prompts = [modules["I"] + [t for name in order for t in modules[name]] + question for order in orders]
    first_same, overlaps, gaps = 0, [], []
    for prompt in prompts:
        llm.reset_prefix_cache()
        before = figures(llm)["tokens_loaded"]
        spliced = generate(llm, [prompt], logprobs=TOP)[0].outputs[0]
        loaded = figures(llm)["tokens_loaded"] - before
        assert loaded == len(prompt) - len(question)
        recomputed = generate(llm, [prompt], recompute=True, logprobs=TOP)[0].outputs[0]
        first_same += spliced.token_ids[0] == recomputed.token_ids[0]
        ours, theirs = spliced.logprobs[0], recomputed.logprobs[0]
        common = set(ours) & set(theirs)
        overlaps.append(len(common) / len(set(ours) | set(theirs)))
        gaps.extend(abs(ours[t].logprob - theirs[t].logprob) for t in common)
    # Expected differences: spliced modules attended only within themselves in every layer after the first, so
    # the question sees other KV than a full recomputation. README records the figures printed here.
    print(
        f"\nmodules in varying order, {len(prompts)} prompts: first greedy token equal in {first_same}; top-{TOP} "
        f"first-token candidates overlap {sum(overlaps) / len(overlaps):.2f} (Jaccard); their log-probabilities "
        f"differ by {sum(gaps) / len(gaps):.4f} on average, {max(gaps):.4f} at most"
    )
    assert len(overlaps) == len(orders) and gaps


def _kvreuse_counter(name: str) -> float:
    """A ``kvreuse:`` counter of the offline front end, summed over its labels (this process's registry)."""
    from prometheus_client import REGISTRY

    return sum(s.value for family in REGISTRY.collect() for s in family.samples if s.name == name)


def _set_sparse(flags):
    def call(worker):
        from kvreuse.vllm.runtime import configure_sparse

        configure_sparse(flags)

    return call


def test_the_module_counters_and_the_sparse_figures_reach_vllms_metrics_through_the_connector(llm, modules, question):
    """One connector carries both: the module cache's counters, and those of the sparse backend when it decodes
    with DIPR (here every layer at beta = inf, which attends to everything)."""
    llm.reset_prefix_cache()
    names = (
        "kvreuse:module_tokens_loaded_total",
        "vllm:kvreuse_sparse_blocks_total",
        "vllm:kvreuse_sparse_blocks_read_total",
    )
    before = [_kvreuse_counter(name) for name in names]
    llm.collective_rpc(_set_sparse({"beta": float("inf"), "min_context": 0, "dense_layers": 0}))
    try:
        generate(llm, [modules["C"] + question])
    finally:
        llm.collective_rpc(_set_sparse({"beta": float("inf")}))
    loaded, blocks, read = (_kvreuse_counter(name) - was for name, was in zip(names, before))
    assert loaded == len(modules["C"])
    assert blocks > 0 and read == blocks


def test_a_module_the_worker_lost_is_recomputed_not_served_wrong(llm, modules, question):
    from kvreuse.vllm.modules import encode_modules

    def lose(worker, name):
        key = next(key for key in worker.store._where if key.name == name)
        return worker.store.evict(key)

    prompt = modules["B"] + question
    expected = generate(llm, [prompt], recompute=True, logprobs=LOGPROBS)[0].outputs[0]  # the reference
    assert llm.collective_rpc(_call(lose, "B")) == [True]
    llm.reset_prefix_cache()
    failures = figures(llm)["load_failures"]
    served = generate(llm, [prompt], logprobs=LOGPROBS)[0]
    assert figures(llm)["load_failures"] == failures + 1
    # Recomputed after the failed load: not served from a wrong or partial KV. vLLM may schedule the recomputation
    # in other chunks than a fresh prefill, so compare as two computations of the same math (greedy.py).
    assert_same_greedy_path(expected, served.outputs[0], "module B recomputed after its loss")
    # The worker reported the loss: the scheduler plans no more loads of B until it is encoded again.
    llm.reset_prefix_cache()
    generate(llm, [prompt])
    assert figures(llm)["load_failures"] == failures + 1
    encode_modules(llm, {"B": TEXTS["B"]})
    llm.reset_prefix_cache()
    before = figures(llm)["tokens_loaded"]
    generate(llm, [prompt])
    assert figures(llm)["tokens_loaded"] - before == len(modules["B"])


def test_malformed_encode_parameters_leave_the_request_served_and_store_nothing(llm, modules):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    before = figures(llm)["modules"]
    params = SamplingParams(
        max_tokens=2, extra_args={"kv_transfer_params": {"kvreuse_module": "broken", "kvreuse_context": 10_000}}
    )
    out = llm.generate([TokensPrompt(prompt_token_ids=modules["C"])], params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2
    assert figures(llm)["modules"] == before


SCHEMA = """<schema name="trip">
<system>You plan trips.
</system><module name="doc-a">Paris has museums, cafes and a river with many bridges.
</module><union><module name="summer">Summer days are long and warm.
</module><module name="winter">Winter days are short and cold.
</module></union><module name="plan">Plan a trip of <param name="days" len="3"/> days.
</module></schema>"""


def test_a_pml_schema_is_encoded_and_its_prompts_are_served_from_it(llm):
    from kvreuse.vllm.modules import encode_schema, pml_prompt

    layout = encode_schema(llm, SCHEMA)
    ids = pml_prompt(llm, '<prompt schema="trip"><doc-a/><winter/><plan days="3"/>Where to?</prompt>', layout)
    llm.reset_prefix_cache()
    before = figures(llm)["tokens_loaded"]
    out = generate(llm, [ids])[0]
    loaded = figures(llm)["tokens_loaded"] - before
    # The scaffold, doc-a, winter and the text of plan before its param come from the cache; the argument and
    # what follows it are computed (one run of loaded tokens per request, see kvreuse.modules.splice).
    assert loaded == out.num_cached_tokens > len(layout.modules["doc-a"].token_ids)
    assert loaded < len(ids)


@pytest.mark.parametrize(
    "prompt, problem",
    [
        ('<prompt schema="trip"><doc-b/></prompt>', "unknown module 'doc-b'"),
        ('<prompt schema="trip"><plan days="three whole days and nights"/></prompt>', "longer than its param"),
        ('<prompt schema="trip"><summer/><winter/></prompt>', "members of one union"),
        ('<prompt schema="trip"><doc-a></prompt>', "line 1"),
    ],
)
def test_bad_pml_prompts_name_the_problem_and_where(llm, prompt, problem):
    from kvreuse.errors import PMLError
    from kvreuse.vllm.modules import pml_prompt, schema_layout

    layout = schema_layout(llm, SCHEMA)
    with pytest.raises(PMLError, match="line 1") as error:
        pml_prompt(llm, prompt, layout)
    assert problem in str(error.value)


def test_a_malformed_pml_schema_names_the_line(llm):
    from kvreuse.errors import PMLError
    from kvreuse.vllm.modules import encode_schema

    with pytest.raises(PMLError, match="line 3"):
        encode_schema(
            llm, '<schema name="x">\n<module name="a">text</module>\n<module name="a">again</module></schema>'
        )


def test_spider_tables_are_encoded_after_the_tables_they_reference_and_found_in_any_order(llm, question):
    from kvreuse.localmodel import DATASETS
    from kvreuse.modules.schemas import spider_schema, text_to_sql_prompt
    from kvreuse.vllm.modules import encode_database

    schema = spider_schema(DATASETS / "spider" / "tables.json", "concert_singer")
    ids = encode_database(llm, schema)
    assert set(ids) == {t.name for t in schema.tables}
    tables = [t.name for t in schema.tables]
    random.Random(0).shuffle(tables)
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode(text_to_sql_prompt(schema, tables, "How many singers are there?"))
    llm.reset_prefix_cache()
    before = figures(llm)["tokens_loaded"]
    generate(llm, [prompt])
    # The prompt starts with a free-text line ("Database ...:"), so nothing is loaded: loads must start where the
    # prefix hit ends. With that line registered too, every table is served from the cache.
    assert figures(llm)["tokens_loaded"] == before
    from kvreuse.vllm.modules import encode_modules

    header = f"Database {schema.name}:"
    encode_modules(llm, {"header": header})
    llm.reset_prefix_cache()
    generate(llm, [prompt])
    assert figures(llm)["tokens_loaded"] - before == sum(len(ids[t]) for t in tables) + len(
        tokenizer.encode(header + "\n", add_special_tokens=False)
    )


def test_two_databases_that_share_a_table_name_are_both_encoded_and_served(llm):
    """Spider's ``concert_singer`` and ``singer`` both have a table ``singer`` (with other columns): each database's
    tables are stored under ``DATABASE.TABLE``, so encoding the second is not refused as a conflict."""
    from kvreuse.localmodel import DATASETS
    from kvreuse.modules.schemas import spider_schema, text_to_sql_prompt
    from kvreuse.vllm.modules import encode_database, encode_modules

    tables_json = DATASETS / "spider" / "tables.json"
    first, second = spider_schema(tables_json, "concert_singer"), spider_schema(tables_json, "singer")
    assert first.table("singer").ddl() != second.table("singer").ddl()
    encode_database(llm, first)
    ids = encode_database(llm, second)
    header = f"Database {second.name}:"
    encode_modules(llm, {f"header-{second.name}": header})
    tokenizer = llm.get_tokenizer()
    tables = [t.name for t in second.tables]
    prompt = tokenizer.encode(text_to_sql_prompt(second, tables, "How many singers are there?"))
    llm.reset_prefix_cache()
    before = figures(llm)["tokens_loaded"]
    generate(llm, [prompt])
    assert figures(llm)["tokens_loaded"] - before == sum(len(ids[t]) for t in tables) + len(
        tokenizer.encode(header + "\n", add_special_tokens=False)
    )
