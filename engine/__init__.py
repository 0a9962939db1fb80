"""pdserve's serving core. `from engine import LLM, SamplingParams` is the offline API.

Names resolve lazily (PEP 562), so `import engine.protocol` stays torch-free and cheap.
"""


def __getattr__(name: str):
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
