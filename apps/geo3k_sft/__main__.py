"""Entry point for `uv run apps/geo3k_sft`."""

from geo3k_sft.main import main

if __name__ == "__main__":
    main()
