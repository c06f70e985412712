"""The architecture sweep of issue 30: every ``transformers`` model type and one model per ``timm`` family."""
