"""Joining a Ray cluster the user started (`ray start --head`, then `ray start --address=...`).

Ray 2.60 turns token authentication on for a cluster that `ray start --head` starts and keeps
the token in ``~/.ray/auth_token``; a driver sends it only with ``RAY_AUTH_MODE=token``, and
without it ``ray.init(address=...)`` spends over 20 s before a message that names neither the
token nor the fix. :func:`check_cluster` settles the three ways joining fails before
``ray.init``, each in seconds and in one line: nothing listening at the address, no token to
send, a token the cluster refuses. Ray's own lookup finds the token (RAY_AUTH_TOKEN,
RAY_AUTH_TOKEN_PATH, ``~/.ray/auth_token``: ``ray/_private/authentication/``), and an explicit
RAY_AUTH_MODE is respected.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator

from rl_runtime.preflight import PreflightError

log = logging.getLogger(__name__)

TOKEN_HELP = (
    "copy the head's ~/.ray/auth_token to ~/.ray/auth_token here, or set RAY_AUTH_TOKEN "
    "(or RAY_AUTH_TOKEN_PATH) to it"
)


def check_cluster(address: str, *, timeout_s: float = 3.0) -> str | None:
    """Check that the cluster at `address` ("host:port", or "auto": the one `ray start` left
    on this machine) answers and accepts this driver, turning token authentication on where a
    token exists; returns the GCS address (None for a ``ray://`` client address, left to Ray).
    Raises `PreflightError` with the cause and the fix."""
    if "://" in address:
        return None
    gcs = _gcs_address(address)
    _check_listening(gcs, address, timeout_s)
    token = use_cluster_token()
    if token and not _has_token():  # Ray's C++ client would abort this process
        raise PreflightError(
            f"RAY_AUTH_MODE=token is set but no token was found for the Ray cluster at {gcs}: "
            f"{TOKEN_HELP}"
        )
    _check_accepted(gcs, token)
    return gcs


def _has_token() -> bool:
    from ray._raylet import AuthenticationTokenLoader

    return AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True)


def use_cluster_token() -> bool:
    """Turn token authentication on for this driver (and the workers it starts) when a token
    is found where Ray looks for one; whether it is on."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token authentication
        return False
    # Ray warns "Set RAY_AUTH_MODE=disabled to opt out", which a driver cannot do to a cluster
    ray_log = logging.getLogger(maybe_enable_token_auth_if_token_available.__module__)
    level = ray_log.level
    ray_log.setLevel(logging.ERROR)
    try:
        on = maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    finally:
        ray_log.setLevel(level)
    if on:
        log.info("Ray token authentication on (the token from Ray's lookup)")
    return on


def _gcs_address(address: str) -> str:
    from ray._private.services import canonicalize_bootstrap_address

    try:
        gcs = canonicalize_bootstrap_address(address)
    except (ConnectionError, ValueError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise PreflightError(f"no Ray cluster at {address!r} ({first})") from None
    if gcs is None:
        raise PreflightError(
            f"Ray address {address!r} names no running cluster: start one with "
            "`ray start --head` or pass its host:port as --ray-address"
        )
    return gcs


def _check_listening(gcs: str, address: str, timeout_s: float) -> None:
    """Nothing listening: Ray itself retries for over a minute before saying so."""
    host, _, port = gcs.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as err:
        named = address if address == gcs else f"{address} ({gcs})"
        raise PreflightError(
            f"nothing answers at Ray address {named}: {err}; start the head there "
            f"(`ray start --head --port={port}`) or pass the right --ray-address"
        ) from None


def _check_accepted(gcs: str, token: bool) -> None:
    """Ask the GCS for the cluster id, as ``ray.init`` does first; a refused token answers at
    once (``ray.exceptions.AuthenticationError``)."""
    from ray._raylet import GcsClient
    from ray.exceptions import AuthenticationError

    try:
        with _quiet_stderr():  # Ray's C++ client logs the refusal too, in a line of its own
            GcsClient(address=gcs).cluster_id  # noqa: B018 (the request is the check)
    except AuthenticationError:
        if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
            raise PreflightError(
                f"the Ray cluster at {gcs} requires an authentication token and "
                "RAY_AUTH_MODE=disabled turns it off for this driver: unset RAY_AUTH_MODE"
            ) from None
        if token:
            raise PreflightError(
                f"the Ray cluster at {gcs} refused this driver's authentication token (not "
                f"the head's): {TOKEN_HELP}"
            ) from None
        raise PreflightError(
            f"the Ray cluster at {gcs} requires an authentication token (`ray start --head` "
            f"turns it on) and this driver has none: {TOKEN_HELP}"
        ) from None
    except Exception as err:  # anything else: ray.init reports it
        log.debug("Ray GCS probe of %s: %s", gcs, err)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null (native code writes there directly)."""
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)
