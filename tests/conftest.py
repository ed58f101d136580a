from tests.fixtures_models import smollm2_dir, smollm2_gguf  # noqa: F401  (shared fixtures)
