"""CURVE from Python: keys made with ddiloco.write_curve_keys (ddiloco_keygen's files), a syncer with
its key file and an allow-list, a learner with its own key and the syncer's public key. Under CURVE the
syncer leaves a contribution's payload CRC-32C to CURVE's MAC, which covers every byte, unless
payload_crc=True; either way an authenticated learner's contributions are merged, and a learner whose
key is not on the allow-list never joins."""
import time

import pytest
import torch

import ddiloco
from conftest import Tiny, train_step

H, TAU, P = 4, 1, 2
TIME_BOUND_S = 60


def write_keys(tmp_path):
    """syncer.key/.pub, learner0.key/.pub and allow.txt (learner 0's public key) in tmp_path."""
    ddiloco.write_curve_keys(str(tmp_path / "syncer"))
    public = ddiloco.write_curve_keys(str(tmp_path / "learner0"))
    (tmp_path / "allow.txt").write_text(f"0 {public}\n")


def test_write_curve_keys_writes_a_private_key_file_and_a_public_one(tmp_path):
    public = ddiloco.write_curve_keys(str(tmp_path / "a"))
    assert len(public) == 40
    key, pub = (tmp_path / "a.key").read_text(), (tmp_path / "a.pub").read_text()
    assert f"public {public}\n" in key and "secret " in key
    assert f"public {public}\n" in pub and "secret" not in pub
    assert (tmp_path / "a.key").stat().st_mode & 0o777 == 0o600
    assert ddiloco.write_curve_keys(str(tmp_path / "b")) != public
    with pytest.raises(ddiloco.InvalidArgument, match="cannot write key file"):
        ddiloco.write_curve_keys(str(tmp_path / "no-such-dir" / "c"))


# The second case also spreads the syncer's connections over two ZeroMQ I/O threads.
@pytest.mark.parametrize("payload_crc, checks, io_threads", [(False, "authenticated", 1), (True, "deferred", 2)])
def test_a_curve_learner_is_merged_and_the_payload_crc_is_compared_only_when_asked(tmp_path, payload_crc, checks,
                                                                                    io_threads):
    write_keys(tmp_path)
    model = Tiny(seed=1)
    s = ddiloco.Syncer(model, keys=str(tmp_path / "syncer.key"), allow=str(tmp_path / "allow.txt"),
                       payload_crc=payload_crc, fragments=P, sync_every=H, overlap=TAU, io_threads=io_threads)
    try:
        assert s.status()["payload_checks"] == checks
        ln = ddiloco.Learner(model, endpoint=s.endpoint, id=0, keys=str(tmp_path / "learner0.key"),
                             server_key=str(tmp_path / "syncer.pub"), fragments=P, sync_every=H, overlap=TAU,
                             join_timeout=30).join()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        end = time.monotonic() + TIME_BOUND_S
        step = 0
        # Every fragment merged twice: the learner's contributions pass every check the mode makes;
        # and the learner has decoded a global into a vector an earlier global used (its third at
        # the latest, after the two of its join's full state).
        while s.status()["merges"] < 2 * P or ln.status()["payload_buffers_reused"] < 1:
            assert time.monotonic() < end, (f"no {2 * P} merges and a recycled global in {TIME_BOUND_S} s: "
                                            f"{s.status()['line']}, {ln.status()['payload_buffers_reused']}")
            step += 1
            train_step(model, opt, step)
            ln.step(tokens=7)
            time.sleep(0.005)
        st = s.status()
        assert st["rejected_total"] == 0, st["rejected"]
        assert st["auth_denied"] == 0 and st["decode_errors"] == 0
        assert st["contributions_accepted"] >= 2 * P
        assert 1 <= st["payloads_encoded"] <= st["frames_out"]
        ln.close()
    finally:
        s.close()


def test_a_learner_whose_key_is_not_allowed_never_joins(tmp_path):
    write_keys(tmp_path)
    ddiloco.write_curve_keys(str(tmp_path / "stranger"))
    model = Tiny(seed=1)
    s = ddiloco.Syncer(model, keys=str(tmp_path / "syncer.key"), allow=str(tmp_path / "allow.txt"),
                       fragments=P, sync_every=H, overlap=TAU)
    try:
        ln = ddiloco.Learner(model, endpoint=s.endpoint, id=0, keys=str(tmp_path / "stranger.key"),
                             server_key=str(tmp_path / "syncer.pub"), fragments=P, sync_every=H, overlap=TAU,
                             join_timeout=2)
        with pytest.raises(ddiloco.TransportError):
            ln.join()
        # The learner's socket keeps trying until it is closed: each handshake is denied and counted.
        end = time.monotonic() + TIME_BOUND_S
        while s.status()["auth_denied"] == 0:
            assert time.monotonic() < end, f"no denied handshake in {TIME_BOUND_S} s: {s.status()}"
            time.sleep(0.01)
        assert s.status()["joins"] == 0
        ln.close()
    finally:
        s.close()


def test_a_plaintext_syncer_compares_the_payload_crc(syncer_of, tiny):
    assert syncer_of(tiny).status()["payload_checks"] == "deferred"
