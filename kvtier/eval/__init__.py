"""Offline evaluations of the KV memory: passkey recall on real models (recall.py), needles
planted in random keys (planted.py), KV-format KL (kv_kl.py)."""


def summary_bits(method: str) -> int:
    """An eval's selector method's page-summary width: "<selector>/8" -> 8 (kv/summaries.py's
    codes), else 16."""
    return 8 if method.endswith("/8") else 16


def retrieval_methods(pool, scale: float, methods: list[str], budget: int, sink: int, window: int,
                      record: bool, kernel: bool | None = None) -> tuple[dict, dict]:
    """Both evals' retrieval backends over one pool: (page summaries by width, backend by method).
    A method "<selector>/8" scores 8-bit summaries; methods of one width share one PageSummaries."""
    from kvtier.config import RetrievalConfig
    from kvtier.kv.summaries import PageSummaries
    from kvtier.layers.retrieval import RetrievalAttention

    by_bits = {b: PageSummaries.for_pool(pool, bits=b) for b in sorted({summary_bits(m) for m in methods})}
    backends = {m: RetrievalAttention(pool, scale, RetrievalConfig(budget=budget, sink=sink, window=window,
                                                                   selector=m.split("/")[0]),
                                      summaries=by_bits[summary_bits(m)], record=record, kernel=kernel)
                for m in methods}
    return by_bits, backends
