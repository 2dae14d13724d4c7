mod common;
use common::*;
use postgres_outbox::*;
use std::time::Duration;
use std::sync::{Arc, Mutex};

#[test]
fn smoke() {
    let (outbox, mut client) = outbox("smoke");
    outbox.migrate(&mut client).unwrap();
    let mut tx = client.transaction().unwrap();
    let k = outbox.enqueue(&mut tx, Message::new("t", "p").header("a", "b").aggregate_key("x")).unwrap();
    let e = outbox.enqueue(&mut tx, Message::new("t", "p").key(k.clone())).unwrap_err();
    assert!(e.is_duplicate_key());
    let ks = outbox.enqueue_all(&mut tx, (0..10).map(|i| Message::new("t", format!("p{i}")).header("i", i.to_string()))).unwrap();
    assert_eq!(ks.len(), 10);
    let e = outbox.enqueue_all(&mut tx, vec![Message::new("t", "p").key("fresh"), Message::new("t", "p").key(k.clone())]).unwrap_err();
    assert_eq!(e.duplicate_keys(), &[k.clone()]);
    tx.commit().unwrap();
    println!("{:?}", outbox.stats(&mut client).unwrap());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s2 = seen.clone();
    let config = RelayConfig::new(outbox.clone(), pool(5), move || {
        let s = s2.clone();
        Ok::<_, std::io::Error>(publisher_fn(move |r: &Record| { s.lock().unwrap().push(r.clone()); Ok(()) }))
    });
    let relay = Relay::spawn(config).unwrap();
    wait_until("all published", || seen.lock().unwrap().len() == 11);
    wait_until("listening", || relay.is_listening());
    let mut tx = client.transaction().unwrap();
    outbox.enqueue(&mut tx, Message::new("t", "p")).unwrap();
    tx.commit().unwrap();
    wait_until("12 published", || seen.lock().unwrap().len() == 12);
    let r = relay.shutdown(Duration::from_secs(5)).unwrap();
    println!("{r:?} {:?}", outbox.stats(&mut client).unwrap());
    println!("{:?}", seen.lock().unwrap()[1]);
}
