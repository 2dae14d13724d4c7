//! The connection pool with its TLS type erased, and the long-lived sessions relay threads
//! hold on it.

use std::ops::DerefMut;
use std::sync::Arc;

use postgres::tls::{MakeTlsConnect, TlsConnect};
use postgres::{Client, Socket};
use r2d2_postgres::PostgresConnectionManager;

use crate::error::Result;
use crate::store::{Conn, StatementCache};

/// A checked-out connection.
pub(crate) type Pooled = Box<dyn DerefMut<Target = Client> + Send>;

/// A pool of PostgreSQL connections, whatever its TLS connector.
pub(crate) trait Pool: Send + Sync {
    fn get(&self) -> Result<Pooled>;
    fn max_size(&self) -> u32;
}

impl<T> Pool for r2d2::Pool<PostgresConnectionManager<T>>
where
    T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
    T::Stream: Send,
    T::TlsConnect: Send,
    <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
{
    fn get(&self) -> Result<Pooled> {
        Ok(Box::new(r2d2::Pool::get(self)?))
    }

    fn max_size(&self) -> u32 {
        r2d2::Pool::max_size(self)
    }
}

/// A connection opened outside the pool, as the pool's connections are used.
pub(crate) struct Dedicated(pub(crate) Client);

impl std::ops::Deref for Dedicated {
    type Target = Client;

    fn deref(&self) -> &Client {
        &self.0
    }
}

impl DerefMut for Dedicated {
    fn deref_mut(&mut self) -> &mut Client {
        &mut self.0
    }
}

/// A connection a relay thread keeps checked out, with its prepared statements; a broken
/// connection is dropped and the next call checks out a fresh one.
pub(crate) struct Session {
    pool: Arc<dyn Pool>,
    conn: Option<(Pooled, StatementCache)>,
}

impl Session {
    pub(crate) fn new(pool: Arc<dyn Pool>) -> Session {
        Session { pool, conn: None }
    }

    pub(crate) fn run<R>(
        &mut self,
        f: impl FnOnce(&mut Conn<'_, Client>) -> Result<R>,
    ) -> Result<R> {
        let (client, cache) = match &mut self.conn {
            Some(conn) => conn,
            None => self
                .conn
                .insert((self.pool.get()?, StatementCache::default())),
        };
        let result = f(&mut Conn {
            client: &mut **client,
            cache: Some(cache),
        });
        if result.is_err() && client.is_closed() {
            self.conn = None;
        }
        result
    }
}
