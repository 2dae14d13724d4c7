-- A failure counted once however often its reply is lost, and a dead letter known to be
-- stored.
--
-- A consumer counts a handler's failure in a statement of its own after the rollback. When
-- the reply to it is lost (the connection dies, the server stops answering) the count may
-- or may not have been made, and counting again must not charge the one failure twice: each
-- count names the handling it is for (`attempt`), and a count for the same handling answers
-- with the count it made.
--
-- A consumer acks a message it gives up on only once its dead letter is stored (confirmed by
-- the broker); if that ack is lost, the broker delivers the message again. `buried` says the
-- dead letter is stored, so the redelivery is acked without a second dead letter. The row
-- stays until the message is handled again (a redriven copy: its success deletes the row,
-- its failure starts a count afresh) or until `Purge::Inbox` ages it out.
ALTER TABLE {failures}
    ADD COLUMN attempt uuid,
    ADD COLUMN buried boolean NOT NULL DEFAULT false;
