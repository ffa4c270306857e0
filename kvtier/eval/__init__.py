"""Offline evaluations of the KV memory: passkey recall on real models (recall.py), needles
planted in random keys (planted.py), KV-format KL (kv_kl.py)."""


def summary_bits(method: str) -> int:
    """An eval's selector method's page-summary width: "<selector>/8" -> 8 (kv/summaries.py's
    codes), else 16."""
    return 8 if method.endswith("/8") else 16
