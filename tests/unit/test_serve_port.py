"""`orchard serve --port`: one setting moves the server (a copy of the config with that port is what `serve run`
reads) and the other commands find it (the URL it records), unless $ORCHARD_URL names another server."""

from __future__ import annotations

import yaml

from deployments.cli import server_client
from deployments.cli.serve import _read_target

CONFIG = """\
proxy_location: HeadOnly
http_options:
  host: 127.0.0.1
  port: 8000
applications:
  - name: orchard
    route_prefix: /
    import_path: deployments.app:build_app
    args: {}
"""


def test_port_runs_a_copy_of_the_config_on_that_port(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHARD_HOME", str(tmp_path / "home"))
    config = tmp_path / "serve_config.yaml"
    config.write_text(CONFIG)

    default = _read_target(config)
    bodega = _read_target(config, 44468)

    assert (default.port, default.url, default.run_path) == (8000, "http://127.0.0.1:8000", config.resolve())
    assert (bodega.port, bodega.url) == (44468, "http://127.0.0.1:44468")
    assert bodega.run_path.parent == tmp_path / "home" / "run" and bodega.config_path == config.resolve()
    copied = yaml.safe_load(bodega.run_path.read_text())
    original = yaml.safe_load(CONFIG)
    assert copied["http_options"] == {"host": "127.0.0.1", "port": 44468}
    assert {k: v for k, v in copied.items() if k != "http_options"} == \
        {k: v for k, v in original.items() if k != "http_options"}
    assert yaml.safe_load(config.read_text()) == original  # the operator's file is untouched


def test_the_other_commands_find_the_server_orchard_serve_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHARD_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ORCHARD_URL", raising=False)
    assert server_client.default_url() == server_client.DEFAULT_URL

    server_client.record_server_url("http://127.0.0.1:44468")
    assert server_client.default_url() == "http://127.0.0.1:44468"
    monkeypatch.setenv("ORCHARD_URL", "http://127.0.0.1:9999")
    assert server_client.default_url() == "http://127.0.0.1:9999"  # named by the user: wins

    server_client.forget_server_url("http://127.0.0.1:1234")  # another server's stop leaves this record
    monkeypatch.delenv("ORCHARD_URL")
    assert server_client.default_url() == "http://127.0.0.1:44468"
    server_client.forget_server_url("http://127.0.0.1:44468")
    assert server_client.default_url() == server_client.DEFAULT_URL
