"""Request reordering: send the rows of an LLM job over a table so that consecutive prompts share prefixes.

Engine-free: ``prepare_table`` and ``render_prompt`` turn a table into prompts, ``solve`` orders its rows and
each row's fields (GGR is the method to use; ``pin`` keeps chosen fields leading), ``prefix_hit_count`` and
``block_hit_stats`` measure an order, ``bucket_stream`` reorders a stream in bounded memory, and
``rerank_by_module_sets`` orders requests built from cached modules.
"""

from kvreuse.reorder.bucketing import bucket_stream
from kvreuse.reorder.config import ReorderConfig
from kvreuse.reorder.dependencies import discover_fds, merge_fds
from kvreuse.reorder.measures import BlockHitStats, block_hit_stats, prefix_hit_count
from kvreuse.reorder.ophr import OPHR_MAX_COLS, OPHR_MAX_ROWS
from kvreuse.reorder.ordering import Ordering, prompts
from kvreuse.reorder.pinning import FIELD_ORDERS, FieldOrder, field_pin, resolve_pin
from kvreuse.reorder.rerank import rerank_by_module_sets, total_hamming_distance
from kvreuse.reorder.solvers import METHODS, Order, solve
from kvreuse.reorder.stats import ColumnStats, column_stats, fixed_field_order
from kvreuse.reorder.table import PROMPT_FORMATS, PromptFormat, prepare_table, render_prompt
from kvreuse.reorder.tokens import TokenHitMeasure, token_hit_measure

__all__ = [
    "FIELD_ORDERS",
    "METHODS",
    "OPHR_MAX_COLS",
    "OPHR_MAX_ROWS",
    "PROMPT_FORMATS",
    "BlockHitStats",
    "FieldOrder",
    "Order",
    "PromptFormat",
    "ColumnStats",
    "Ordering",
    "TokenHitMeasure",
    "ReorderConfig",
    "block_hit_stats",
    "bucket_stream",
    "column_stats",
    "discover_fds",
    "field_pin",
    "fixed_field_order",
    "merge_fds",
    "prefix_hit_count",
    "prepare_table",
    "prompts",
    "render_prompt",
    "rerank_by_module_sets",
    "resolve_pin",
    "solve",
    "token_hit_measure",
    "total_hamming_distance",
]
