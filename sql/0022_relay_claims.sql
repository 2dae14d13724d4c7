-- Relays say when they last claimed.
--
-- A row due past the doctor's threshold was reported as one no relay claimed, where the
-- relays may have claimed all along and fallen behind. Each report now gives the time of
-- the relay's last claim (taking rows or not) and its poll interval, so that the doctor
-- tells relays that do not keep up from relays that do not claim.
ALTER TABLE {relays} ADD COLUMN claimed_at timestamptz, ADD COLUMN poll_interval interval;
