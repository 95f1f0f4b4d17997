"""An agent's run in a real browser: from a proposal to its turn, what the model saw, on a phone."""

import pytest

import durable
from durable.models import Approval, Outbox
from durable.testing import reply, tool_call
from tests.test_browser_operator import DESKTOP, PHONE, overflow
from tests.test_console_support import VIEW, log_in, make_user

from .test_actions_support import in_state

pytest_plugins = ["tests.test_actions_support"]
pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def proposal(drive, receiver):
    script = [reply(tool_calls=[tool_call("lookup_order", {"order_id": "A-7"}, id="c1"),
                                tool_call("open_ticket", {"subject": "Refund for A-7"}, id="k1")],
                    usage=(120, 20), cost="0.02"),
              reply("I will refund the order.",
                    tool_calls=[tool_call("issue_refund", {"order_id": "A-7", "amount": 400}, id="r1")],
                    usage=(180, 25), cost="0.03"),
              reply("Done.")]
    durable.submit("test_agent", "chat-7", {"script": script, "message": "Please refund order A-7"})
    drive(in_state("chat-7", "awaiting_approval"))
    return Approval.objects.get(job_id="chat-7")


def test_an_operator_follows_a_proposal_to_the_turn_and_reads_what_the_model_saw(page, live_server,
                                                                                 proposal):
    make_user("olga", *VIEW)
    log_in(page, live_server, "olga", to=f"/admin/durable/approvals/{proposal.pk}/", viewport=DESKTOP)

    support = page.locator("#proposal-turn")
    assert "lookup_order" in support.inner_text() and "delivered" in support.inner_text()
    support.locator("a.durable-turn-link").click()
    page.wait_for_url("**/admin/durable/job/chat-7/change/#turn-2-sent")
    sent = page.locator("#turn-2-sent")
    assert sent.is_visible()
    text = sent.inner_text()
    assert "as recorded" in text and "the 2 shown in the turns above, then" in text
    assert "asks for lookup_order" in text and "result of c1" in text and "T-000001" in text

    # Turn 1 is folded; opening it shows the system prompt and the customer's message.
    first = page.locator("#turn-1")
    assert not first.locator("#turn-1-sent").is_visible()
    first.locator("summary").first.click()
    assert "You are a support agent." in first.locator("#turn-1-sent").inner_text()
    assert "Please refund order A-7" in first.locator("#turn-1-sent").inner_text()
    ticket = first.locator("tr[data-call='t1/tool/k1']")
    assert "Sent create_ticket on test_receiver: it happened" in ticket.inner_text()
    raw = ticket.locator("details.durable-raw", has_text="The action's row")
    key = Outbox.objects.get(job_id="chat-7").idempotency_key
    assert not raw.locator("pre").is_visible()
    raw.locator("summary").click()
    assert key in raw.locator("pre").inner_text()

    # On a phone the turns and their tool calls stack as cards; nothing sticks out.
    page.set_viewport_size(PHONE)
    assert overflow(page)[0] == 0
    cell = ticket.locator("td").first
    assert cell.evaluate("e => getComputedStyle(e).display") == "block"
    assert ticket.locator("td[data-label='What happened']").is_visible()
