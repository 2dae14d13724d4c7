//! Who may change rows: a client that shows the token, as `Authorization: Bearer <token>`,
//! or a browser holding a session cookie from the login form. A session's forms carry its
//! CSRF token, which a page of another site cannot read, so it cannot post them for you.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rand::RngCore;

use super::http::{Fields, Request, Response};

pub const COOKIE: &str = "outbox_session";
/// How long a login lasts.
const SESSION_LIFE: Duration = Duration::from_secs(12 * 3600);
/// Logins held at once; past it, expired ones go first, then logins are refused.
const MAX_SESSIONS: usize = 1024;
/// The shortest token taken: guessing 16 random characters is out of reach.
pub const MIN_TOKEN: usize = 16;

struct Session {
    csrf: String,
    expires: Instant,
}

/// How a request proved who it is.
pub enum Who {
    Nobody,
    /// The token itself, in a header: no browser sends it on its own, so no CSRF check.
    Bearer,
    /// A login's session, with the CSRF token its forms carry.
    Session {
        csrf: String,
    },
}

impl Who {
    pub fn is_known(&self) -> bool {
        !matches!(self, Who::Nobody)
    }

    /// The CSRF token a page's forms carry for this client.
    pub fn csrf(&self) -> Option<&str> {
        match self {
            Who::Session { csrf } => Some(csrf),
            _ => None,
        }
    }
}

pub struct Auth {
    token: Option<String>,
    sessions: Mutex<HashMap<String, Session>>,
}

impl Auth {
    pub fn new(token: Option<String>) -> Auth {
        Auth {
            token,
            sessions: Mutex::new(HashMap::new()),
        }
    }

    pub fn has_token(&self) -> bool {
        self.token.is_some()
    }

    pub fn who(&self, request: &Request) -> Who {
        let Some(token) = &self.token else {
            return Who::Nobody;
        };
        if let Some(offered) = request
            .header("authorization")
            .and_then(|v| v.strip_prefix("Bearer "))
        {
            if same(offered.trim().as_bytes(), token.as_bytes()) {
                return Who::Bearer;
            }
        }
        let Some(id) = request.cookie(COOKIE) else {
            return Who::Nobody;
        };
        let Ok(sessions) = self.sessions.lock() else {
            return Who::Nobody;
        };
        match sessions.get(id) {
            Some(s) if s.expires > Instant::now() => Who::Session {
                csrf: s.csrf.clone(),
            },
            _ => Who::Nobody,
        }
    }

    /// A new session for a client that offered the right token: its cookie's value.
    pub fn login(&self, offered: &str) -> Result<String, &'static str> {
        let Some(token) = &self.token else {
            return Err("this server has no token: it takes no changes");
        };
        if !same(offered.trim().as_bytes(), token.as_bytes()) {
            return Err("wrong token");
        }
        let mut sessions = self.sessions.lock().map_err(|_| "sessions unavailable")?;
        let now = Instant::now();
        sessions.retain(|_, s| s.expires > now);
        if sessions.len() >= MAX_SESSIONS {
            return Err("too many sessions: try again later");
        }
        let id = random_hex();
        sessions.insert(
            id.clone(),
            Session {
                csrf: random_hex(),
                expires: now + SESSION_LIFE,
            },
        );
        Ok(id)
    }

    pub fn logout(&self, request: &Request) {
        if let (Some(id), Ok(mut sessions)) = (request.cookie(COOKIE), self.sessions.lock()) {
            sessions.remove(id);
        }
    }

    /// A change may go ahead: the client is known and, if by a session, the form carries
    /// that session's CSRF token.
    pub fn allow_change(&self, request: &Request, form: &Fields) -> Result<(), Response> {
        match self.who(request) {
            Who::Nobody => Err(Response::text(
                401,
                "a change needs the token: log in, or send Authorization: Bearer <token>",
            )),
            Who::Bearer => Ok(()),
            Who::Session { csrf } => match form.get("csrf") {
                Some(sent) if same(sent.as_bytes(), csrf.as_bytes()) => Ok(()),
                _ => Err(Response::text(
                    403,
                    "the form's CSRF token is missing or stale: reload the page",
                )),
            },
        }
    }

    /// The cookie that holds session `id`: not for scripts, and never sent along by
    /// another site's request.
    pub fn cookie(id: &str) -> String {
        format!(
            "{COOKIE}={id}; HttpOnly; SameSite=Strict; Path=/; Max-Age={}",
            SESSION_LIFE.as_secs()
        )
    }
}

/// 32 random bytes in hex, from the thread's CSPRNG.
fn random_hex() -> String {
    let mut bytes = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut bytes);
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Compares in time that does not depend on where the two differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_token_logs_in_and_sessions_differ() {
        let auth = Auth::new(Some("0123456789abcdef".into()));
        assert!(auth.login("0123456789abcdeX").is_err());
        assert!(auth.login("").is_err());
        let (a, b) = (
            auth.login("0123456789abcdef").unwrap(),
            auth.login("0123456789abcdef").unwrap(),
        );
        assert_ne!(a, b);
        assert_eq!(a.len(), 64);
        assert!(Auth::new(None).login("anything").is_err());
    }
}
