"""API contracts: every misuse is a ddiloco exception whose message names the value and the fix."""
import re
import time

import pytest
import torch

import ddiloco


def learner(model, endpoint="tcp://127.0.0.1:1", **kw):
    kw.setdefault("plaintext", True)
    return ddiloco.Learner(model, endpoint=endpoint, id=0, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64, torch.float16])
def test_a_non_float32_parameter_is_refused_naming_it_and_the_fix(tiny, dtype):
    tiny.hidden.to(dtype)
    with pytest.raises(ddiloco.InvalidArgument) as e:
        learner(tiny)
    msg = str(e.value)
    assert "'hidden.weight'" in msg and str(dtype) in msg and "model.float()" in msg
    assert msg.startswith("[ddiloco.invalid_argument]")
    assert isinstance(e.value, ValueError) and isinstance(e.value, ddiloco.Error)


def test_a_non_contiguous_parameter_is_refused_naming_it_and_the_fix():
    w = torch.zeros(4, 3).t()  # a transposed view
    with pytest.raises(ddiloco.InvalidArgument, match=r"parameter 'w' \(shape \[3, 4\], strides \[1, 3\]\) is not "
                                                       r"contiguous.*p.data = p.data.contiguous\(\)"):
        learner([("w", w)])


def step_until_it_raises(ln):
    """Steps until the step that reads or writes the changed parameter raises. Push rounds: within
    one period (3 steps) every fragment is due once. Pull rounds: its fragment's first pull, which
    comes once the syncer has seen this learner's metadata (bounded by a deadline, not a count)."""
    if ln.status()["round"] == "push":
        for _ in range(3):
            ln.step(1)
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ln.step(1)
    raise AssertionError(f"no step raised within 30 s: {ln.status()}")


@pytest.mark.parametrize("round", ["push", "pull"])
def test_a_parameter_resized_after_join_fails_at_the_step_that_touches_it_naming_it(tiny, syncer_of, round):
    s = syncer_of(tiny, fragments=3, sync_every=3, overlap=1, round=round)
    ln = learner(tiny, endpoint=s.endpoint, fragments=3, sync_every=3, overlap=1, round=round).join()
    with torch.no_grad():
        tiny.hidden.bias.data = torch.zeros(9)
    with pytest.raises(ddiloco.ShapeMismatch, match=r"parameter 'hidden.bias' has 9 elements \(shape \[9\]\) but had 8 "
                                                    r"when the Learner was created.*resize parameters before"):
        step_until_it_raises(ln)
    ln.close()


@pytest.mark.parametrize("round", ["push", "pull"])
def test_a_parameter_converted_after_join_fails_at_the_step_that_touches_it(tiny, syncer_of, round):
    s = syncer_of(tiny, fragments=3, sync_every=3, overlap=1, round=round)
    ln = learner(tiny, endpoint=s.endpoint, fragments=3, sync_every=3, overlap=1, round=round).join()
    tiny.head.to(torch.bfloat16)
    with pytest.raises(ddiloco.InvalidArgument, match=r"'head.(weight|bias)'.*torch.bfloat16.*model.float\(\)"):
        step_until_it_raises(ln)
    ln.close()


def test_unknown_keywords_are_refused_with_the_closest_known_one(tiny):
    with pytest.raises(TypeError, match=r"ddiloco.Learner: unknown keyword argument 'sync_evry'; did you mean "
                                        r"'sync_every'\?"):
        learner(tiny, sync_evry=4)
    with pytest.raises(TypeError, match=r"ddiloco.Syncer: unknown keyword argument 'quorom'; did you mean 'quorum'"):
        ddiloco.Syncer(tiny, plaintext=True, quorom=2)
    with pytest.raises(TypeError, match=r"unknown keyword argument 'chip'; did you mean 'chips'"):
        ddiloco.sim.simulate_goodput(chip=10)
    with pytest.raises(TypeError, match=r"outer_loop.*tokens_per_step"):
        ddiloco.outer_loop(tiny, torch.optim.SGD(tiny.parameters(), lr=0.1), endpoint="tcp://127.0.0.1:1",
                           id=0).__enter__()


def test_values_of_the_wrong_type_or_range_name_the_keyword(tiny):
    with pytest.raises(TypeError, match=r"ddiloco.Learner: id = -1 must be an int >= 0"):
        ddiloco.Learner(tiny, endpoint="tcp://127.0.0.1:1", id=-1,
                        plaintext=True)
    with pytest.raises(TypeError, match=r"ddiloco.Learner: plaintext = 'yes' must be True or False"):
        ddiloco.Learner(tiny, endpoint="tcp://127.0.0.1:1", id=0, plaintext="yes")
    with pytest.raises(TypeError, match=r"ddiloco.Syncer: outer_lr = 'fast' must be a number"):
        ddiloco.Syncer(tiny, plaintext=True, outer_lr="fast")
    with pytest.raises(ddiloco.InvalidArgument, match=r"join_timeout = 0 s must be a finite number of seconds > 0"):
        learner(tiny, join_timeout=0)
    for io_threads in (0, -1, 65):
        with pytest.raises(ddiloco.InvalidArgument, match=rf"ddiloco.Syncer: io_threads = {io_threads} must be in "
                                                          r"\[1, 64\]"):
            ddiloco.Syncer(tiny, plaintext=True, io_threads=io_threads)
    with pytest.raises(ddiloco.InvalidArgument, match=r"merge = 'median' must be 'rda'"):
        ddiloco.Syncer(tiny, plaintext=True, merge="median")
    with pytest.raises(TypeError, match=r"ddiloco.Syncer: reask_after_steps = -1 must be an int >= 0"):
        ddiloco.Syncer(tiny, plaintext=True, reask_after_steps=-1)
    with pytest.raises(ddiloco.InvalidArgument, match=r"reask_after_steps = 2097152 steps is above 2\^20"):
        ddiloco.Syncer(tiny, plaintext=True, reask_after_steps=2 ** 21)


@pytest.mark.parametrize("endpoint", ["127.0.0.1:5555", "localhost"])
def test_an_endpoint_without_a_scheme_is_refused(tiny, endpoint):
    with pytest.raises(ddiloco.InvalidArgument, match=re.escape(f"endpoint = '{endpoint}' is not a ZeroMQ endpoint; "
                                                                "give the syncer's address as 'tcp://HOST:PORT'")):
        learner(tiny, endpoint=endpoint)


def test_a_malformed_tcp_endpoint_is_a_transport_error_naming_it(tiny):
    with pytest.raises(ddiloco.TransportError, match=r"cannot connect to 'tcp://127.0.0.1:port'.*'tcp://HOST:PORT'"):
        learner(tiny, endpoint="tcp://127.0.0.1:port")


def test_joining_an_endpoint_where_no_syncer_answers_times_out_naming_it(tiny):
    ln = learner(tiny, endpoint="tcp://127.0.0.1:9", join_timeout=0.3, join_retry=0.1)
    with pytest.raises(ddiloco.TransportError, match=r"^\[ddiloco.transport\] OuterLoop::join: learner 0 "
                                                     r"received 0 of 4 fragments.*\(endpoint tcp://127.0.0.1:9, "
                                                     r"security plaintext; the syncer must use the same\)$"):
        ln.join()
    assert isinstance(ddiloco.TransportError("x"), ConnectionError)
    ln.close()


def test_security_must_be_chosen(tiny):
    with pytest.raises(ddiloco.InvalidArgument, match=r"choose the link's security: plaintext=True .* or "
                                                      r"keys='<file>.key' and server_key='syncer.pub'"):
        ddiloco.Learner(tiny, endpoint="tcp://127.0.0.1:1", id=0)
    with pytest.raises(ddiloco.InvalidArgument, match=r"keys='<file>.key' and allow='allow.txt'"):
        ddiloco.Syncer(tiny)


def test_step_before_join_and_negative_or_zero_tokens_are_refused(tiny, syncer_of):
    ln = learner(tiny)
    with pytest.raises(ddiloco.StateError, match=r"step\(\) called before join\(\)"):
        ln.step(1)
    s = syncer_of(tiny)
    ln2 = learner(tiny, endpoint=s.endpoint).join()
    with pytest.raises(ddiloco.InvalidArgument, match=r"tokens = -1 must be > 0"):
        ln2.step(-1)
    # 0 would weigh the contribution 0 (tokens^2 / steps): the C++ message, naming the fix, reaches Python.
    with pytest.raises(ddiloco.InvalidArgument, match=r"tokens = 0 must be > 0 .*no weight.*"
                                                      r"pass the tokens this inner step processed \(batch x sequence "
                                                      r"length\)"):
        ln2.step(0)
    ln.close()
    ln2.close()
    with pytest.raises(ddiloco.StateError, match="the learner is closed"):
        ln2.step(1)


def test_more_fragments_than_tensors_is_refused(tiny):
    with pytest.raises(ddiloco.InvalidArgument, match=r"num_fragments = 9"):
        learner(tiny, fragments=9)


def test_inputs_that_are_not_named_parameters_are_refused(tiny):
    with pytest.raises(TypeError, match="got a single tensor"):
        learner(torch.zeros(3))
    with pytest.raises(TypeError, match=r"item 0 .* not a \(name, tensor\) pair"):
        learner([torch.zeros(3)])
    with pytest.raises(ddiloco.InvalidArgument, match=r"parameter 'x' is a list, not a torch tensor"):
        learner([("x", [1.0, 2.0])])
    with pytest.raises(ValueError, match=r"embedding= names \['nope'\] that are not parameters"):
        learner(tiny, embedding=["nope"])


def test_the_embedding_rule_default_and_overrides(tiny):
    assert learner(tiny).plan["embedding"] == ["tok_emb.weight"]
    assert learner([("tok_emb.weight", torch.zeros(4)), ("member.weight", torch.zeros(4))]).plan["embedding"] == \
        ["tok_emb.weight"]
    assert learner(tiny, embedding=["tok_emb.weight", "head.weight"]).plan["embedding"] == \
        ["tok_emb.weight", "head.weight"]
    assert learner(tiny, embedding=lambda name, p: False).plan["embedding"] == []
    for name in ["embed_tokens.weight", "model.word_embeddings.weight", "transformer.wte.weight", "pos_emb.w"]:
        assert ddiloco.default_embedding_rule(name, torch.zeros(1))
    for name in ["member.weight", "head.weight", "emb"]:
        assert not ddiloco.default_embedding_rule(name, torch.zeros(1))


def test_learner_and_syncer_derive_the_same_plan(tiny, syncer_of):
    s = syncer_of(tiny, fragments=3)
    assert learner(tiny, fragments=3).plan["fingerprint"] == s.fingerprint
