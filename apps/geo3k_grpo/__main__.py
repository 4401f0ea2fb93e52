"""Entry point for `uv run apps/geo3k_grpo`."""

from geo3k_grpo.main import main

if __name__ == "__main__":
    main()
