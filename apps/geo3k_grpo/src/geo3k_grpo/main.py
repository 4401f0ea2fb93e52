"""geo3k_grpo launcher (assembled in the rl-runtime issue)."""


def main() -> None:
    raise SystemExit("geo3k_grpo is not assembled yet")
