"""A pipeline whose action needs approval and whose last step runs after the send."""

from durable import Action, Workflow, step

from .actions_workflows import FAST


class ApprovedTicket(Workflow):
    """Prepare a ticket, create it once a person approved (an action), then read its id."""

    name = "approved_ticket"

    @step
    def prepare(self, payload, ctx):
        return {"subject": payload.get("subject", "Printer on fire")}

    @step(action=True, approval=True, retry=FAST)
    def create_ticket(self, data, ctx):
        return Action("test_receiver", "create_ticket", {"subject": data["subject"]},
                      summary=f"Create the ticket {data['subject']!r}")

    @step
    def confirm(self, memo, ctx):
        return {"ticket": memo["remote_id"]}
