import pytest

import durable
from durable.models import Job


@pytest.mark.django_db(transaction=True)
def test_runworkers_subprocess_drains_submitted_jobs(workers, tmp_path):
    log = tmp_path / "exec.log"
    for i in range(5):
        durable.submit("recorded", f"job-{i}", {"log": str(log)})
    proc = workers.start("--burst", processes=2)
    assert proc.wait(60) == 0, workers.output(proc)
    assert set(Job.objects.values_list("state", flat=True)) == {"c_done"}
    assert len(log.read_text().splitlines()) == 5 * 4
