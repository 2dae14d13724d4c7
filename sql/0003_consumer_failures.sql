-- How often each consumer's handler has failed on each message it has not yet finished.
--
-- A consumer backs off between a message's handler retries and gives up after a set number of
-- failures. The count lives here rather than in the consumer's memory or the broker, so it
-- survives restarts and is shared by every process consuming under the same name, whatever the
-- queue type. A row exists only while its message is being retried: the consumer deletes it
-- when the message commits or is dead-lettered, so the table stays as small as the set of
-- messages failing right now.
CREATE TABLE {failures} (
    consumer   text        NOT NULL,
    key        text        NOT NULL,
    failures   integer     NOT NULL,
    last_error text        NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, key)
);
