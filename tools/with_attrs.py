"""Run the kvtier CLI or a script with module switches set first: an off-by-default kernel path
timed against the default in the same process (each switch is a module attribute read when
kernels launch).

    ATTRS="kvtier.kernels.retrieval_attention:TOPK_FILTER=True" python3 tools/with_attrs.py cli bench ...
    ATTRS="mod:A=1;mod:B=False" python3 tools/with_attrs.py tools/profile_retrieval.py --cases ...

Values are Python literals; a missing attribute is an error. TRACE=1 also traces Triton compiles
(tools/trace_compiles.py)."""
import ast
import importlib
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
for item in filter(None, os.environ.get("ATTRS", "").split(";")):
    target, value = item.split("=", 1)
    mod, attr = target.split(":")
    m = importlib.import_module(mod)
    assert hasattr(m, attr), target
    setattr(m, attr, ast.literal_eval(value))
    print(f"set {target} = {value}", flush=True)
if os.environ.get("TRACE") == "1":
    import trace_compiles  # noqa: F401
if sys.argv[1] == "cli":
    from kvtier.cli import main
    sys.exit(main(sys.argv[2:]))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
