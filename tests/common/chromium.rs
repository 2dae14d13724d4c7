//! Headless Chromium, driven over the DevTools protocol: open a page, read and click what a
//! person would, take a screenshot. `OUTBOX_TEST_CHROMIUM` names the binary (default
//! `chromium`; Debian's package, which `.ci/run` installs).

use std::fs;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use serde_json::{json, Value};
use tungstenite::stream::MaybeTlsStream;
use tungstenite::{Message, WebSocket};

pub struct Browser {
    child: Child,
    profile: PathBuf,
    socket: WebSocket<MaybeTlsStream<TcpStream>>,
    /// The page's session on the browser's connection.
    session: String,
    next_id: u64,
}

impl Browser {
    /// Starts Chromium with a fresh profile and opens a blank page.
    pub fn launch() -> Browser {
        let binary = std::env::var("OUTBOX_TEST_CHROMIUM").unwrap_or_else(|_| "chromium".into());
        let profile = std::env::temp_dir().join(format!(
            "outbox-chromium-{}-{}",
            std::process::id(),
            super::unique_name("p")
        ));
        fs::create_dir_all(&profile).expect("a profile directory");
        let child = Command::new(&binary)
            .args([
                "--headless",
                // Tests run as root in CI containers, where the sandbox cannot start.
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--window-size=1200,900",
                "--remote-debugging-port=0",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg("about:blank")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot start {binary} ({e}): apt-get install chromium, or set OUTBOX_TEST_CHROMIUM")
            });
        // Chromium writes its port and the browser's endpoint here once it listens.
        let active = profile.join("DevToolsActivePort");
        let deadline = Instant::now() + Duration::from_secs(60);
        let endpoint = loop {
            if let Ok(text) = fs::read_to_string(&active) {
                let mut lines = text.lines();
                if let (Some(port), Some(path)) = (lines.next(), lines.next()) {
                    break format!("ws://127.0.0.1:{port}{path}");
                }
            }
            assert!(
                Instant::now() < deadline,
                "Chromium did not start listening"
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        let (socket, _) = tungstenite::connect(endpoint.as_str()).expect("DevTools connection");
        let mut browser = Browser {
            child,
            profile,
            socket,
            session: String::new(),
            next_id: 0,
        };
        let target = browser.call("Target.createTarget", json!({"url": "about:blank"}));
        let attached = browser.call(
            "Target.attachToTarget",
            json!({"targetId": target["targetId"], "flatten": true}),
        );
        browser.session = attached["sessionId"]
            .as_str()
            .expect("a session")
            .to_owned();
        browser.call("Page.enable", json!({}));
        browser
    }

    /// Sends a command (to the page, once attached) and returns its result.
    fn call(&mut self, method: &str, params: Value) -> Value {
        self.try_call(method, params)
            .unwrap_or_else(|error| panic!("{method}: {error}"))
    }

    /// Sends a command and returns its result, or the error Chromium answered with.
    fn try_call(&mut self, method: &str, params: Value) -> Result<Value, Value> {
        self.next_id += 1;
        let id = self.next_id;
        let mut command = json!({"id": id, "method": method, "params": params});
        if !self.session.is_empty() {
            command["sessionId"] = json!(self.session);
        }
        self.socket
            .send(Message::Text(command.to_string().into()))
            .expect("send to Chromium");
        loop {
            let message = self.socket.read().expect("read from Chromium");
            let Ok(text) = message.to_text() else {
                continue;
            };
            let Ok(reply) = serde_json::from_str::<Value>(text) else {
                continue;
            };
            if reply["id"] == json!(id) {
                return match reply.get("error") {
                    Some(error) => Err(error.clone()),
                    None => Ok(reply["result"].clone()),
                };
            }
        }
    }

    /// The value of a JavaScript expression in the page.
    pub fn eval(&mut self, expression: &str) -> Value {
        self.try_eval(expression)
            .unwrap_or_else(|error| panic!("{expression}: {error}"))
    }

    /// The value of an expression, or why there is none (a page navigating away has no
    /// context to evaluate in until the next one loads).
    fn try_eval(&mut self, expression: &str) -> Result<Value, Value> {
        let result = self.try_call(
            "Runtime.evaluate",
            json!({"expression": expression, "returnByValue": true}),
        )?;
        match result.get("exceptionDetails") {
            Some(exception) => Err(exception.clone()),
            None => Ok(result["result"]["value"].clone()),
        }
    }

    /// Waits until `expression` is true in a loaded page.
    pub fn wait_for(&mut self, what: &str, expression: &str) {
        let check = format!("document.readyState === 'complete' && !!({expression})");
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.try_eval(&check) != Ok(json!(true)) {
            assert!(Instant::now() < deadline, "timed out waiting until {what}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Opens `url` and waits until it has loaded.
    pub fn open(&mut self, url: &str) {
        self.call("Page.navigate", json!({"url": url}));
        let target = serde_json::to_string(url).expect("a JSON string");
        self.wait_for(
            &format!("{url} is loaded"),
            &format!("location.href === {target}"),
        );
    }

    /// Clicks the first element `selector` finds whose text contains `text`, and waits for
    /// the page it leads to (its path `path`) to load. The page clicked on is marked, so a
    /// click that leads to the same path waits for the new page, not the old one; the click
    /// itself runs after the evaluation returns, as navigating ends the page's context.
    pub fn click(&mut self, selector: &str, text: &str, path: &str) {
        let (selector, text, path) = (json!(selector), json!(text), json!(path));
        let clicked = self.eval(&format!(
            "(() => {{ const e = [...document.querySelectorAll({selector})]
                 .find(e => e.textContent.includes({text}));
               if (!e) return false;
               window.outboxLeft = true;
               setTimeout(() => e.click(), 0);
               return true; }})()"
        ));
        assert_eq!(clicked, json!(true), "nothing {selector} shows {text}");
        self.wait_for(
            &format!("the page at {path} has loaded"),
            &format!("!window.outboxLeft && location.pathname === {path}"),
        );
    }

    /// The text of the element with `id`, or null.
    pub fn text(&mut self, id: &str) -> Option<String> {
        let id = json!(id);
        self.eval(&format!(
            "(() => {{ const e = document.getElementById({id}); return e && e.textContent; }})()"
        ))
        .as_str()
        .map(str::to_owned)
    }

    /// A PNG of what the page shows, written to `path`.
    pub fn screenshot(&mut self, path: &Path) {
        let shot = self.call("Page.captureScreenshot", json!({"format": "png"}));
        let png = base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().expect("image data"))
            .expect("base64");
        fs::write(path, png).expect("write the screenshot");
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = fs::remove_dir_all(&self.profile);
    }
}
