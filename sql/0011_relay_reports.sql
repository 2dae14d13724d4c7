-- Relays say how they are.
--
-- An operator asking "is the relay up, and does it reach the broker?" had only logs and
-- metrics of each relay process. Each relay now keeps a row here, written every few seconds
-- on a connection it already holds: which process it is, when it was last seen, whether its
-- publishers reach their destination (and since when not), and how many rows it published.
-- `health` (and `doctor`) report a publisher that is down; `serve` shows the rows. A relay
-- deletes its row when it shuts down; the row of one that died stays, with its last
-- sighting, until a relay forgets rows unseen for a day.
CREATE TABLE {relays} (
    relay       text        PRIMARY KEY,
    client_addr text,
    pid         integer     NOT NULL,
    started_at  timestamptz NOT NULL,
    seen_at     timestamptz NOT NULL DEFAULT now(),
    publisher   text        NOT NULL CHECK (publisher IN ('unknown', 'up', 'down')),
    down_since  timestamptz,
    published   bigint      NOT NULL DEFAULT 0
);
