"""Bad inputs of the ondevice area (benchmarks/reliability/ondevice_area.py and its case modules), one test per
case class: every case must end in a recovery that was checked or in one `error:` line naming a fix: no
traceback, no hang, nothing lost, and its fault must have happened (``not_exercised`` fails unless a retry
exercises it). ``python -m benchmarks.reliability --area ondevice`` runs the same cases, each in its own process,
and reports the counts."""
import pytest

from benchmarks.reliability import campaign, harness, ondevice_area

CASES = campaign.load_cases("ondevice")


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
  return ondevice_area.Workspace(str(tmp_path_factory.mktemp("faults")))


@pytest.mark.parametrize("klass", ondevice_area.CASES.classes())
def test_fault_class(ws, klass, request):
  if klass == "ring_peer":
    request.applymarker(pytest.mark.multiprocess)
  bad = []
  for c in [c for c in CASES if c.klass == klass]:
    o = harness.run_until_exercised(c, ws)
    if o.kind not in c.acceptable or o.data_lost:
      bad.append(f"{c.name}: {o.kind}{' + data lost' if o.data_lost else ''}: {o.detail}")
  assert not bad, "\n".join(bad)


def test_every_class_has_cases_and_there_are_at_least_40():
  classes = ondevice_area.CASES.classes()
  assert len(CASES) >= 40 and all(sum(c.klass == k for c in CASES) >= 2 for k in classes)
