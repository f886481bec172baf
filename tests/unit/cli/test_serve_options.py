"""``rlrunbook serve``'s options: their defaults are ServeOptions' own."""

from __future__ import annotations

import dataclasses

from rlrunbook.cli import app


def test_the_serve_options_default_to_the_servers_defaults():
    from rlrunbook.service.server import ServeOptions

    args = app.parse_args(["serve"])
    defaults = ServeOptions()
    given = {"host": args.host, "port": args.port, "max_body_bytes": args.max_body_mib * 2**20,
             "session_timeout_s": args.session_timeout,
             "forget_after_s": args.forget_after, "header_timeout_s": args.header_timeout,
             "body_timeout_s": args.body_timeout, "max_sessions": args.max_sessions,
             "max_models": args.max_models, "max_stored_bytes": args.max_stored_bytes}
    assert given == {name: getattr(defaults, name) for name in given}
    assert {f.name for f in dataclasses.fields(ServeOptions)} >= set(given)
