from tests.fixtures_models import smollm2_dir, smollm2_gguf, smollm2_moe_dir  # noqa: F401  (shared fixtures)
