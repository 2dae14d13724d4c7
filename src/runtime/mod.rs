//! The plumbing the relay and the consumer share: the stop signal and its deadlines, the
//! clock of those deadlines, pooled connections and the sessions on them, the prepared
//! statements of a connection, telling the world's faults from a message's, the retry
//! policy that turns an outcome into a row's next state, and the sizes AMQP frames allow.

pub(crate) mod clock;
pub(crate) mod conn;
pub(crate) mod fault;
pub(crate) mod lifecycle;
pub(crate) mod pool;
pub(crate) mod retry;
pub(crate) mod session;
pub(crate) mod wire;
